"""/v1/chat/completions with images on a real vLLM server: MRV2 on CPU, patched vLLM 0.26.0, tiny LLaVA."""

from __future__ import annotations

import base64

import pytest

from mmcpu_dev.checks import expect_client_error
from mmcpu_dev.payloads import image_chat_kwargs, test_image
from mmcpu_dev.servers import MRV2_LOG_LINE

pytestmark = pytest.mark.slow


def chat(engine, images, seed: int | None = None, **kwargs) -> str:
    extra = {} if seed is None else {"seed": seed}
    result = engine.client().chat.completions.create(**image_chat_kwargs(images, model=engine.name, **kwargs), **extra)
    return result.choices[0].message.content


def test_two_different_images_in_one_request(llava_engine):
    """Both images reach the model: changing only the second one changes the answer (the unpatched engine
    dies on exactly this request: PR #50073's reduce_data fix)."""
    answer = chat(llava_engine, [test_image(1), test_image(2)])
    assert answer.strip()
    assert chat(llava_engine, [test_image(1), test_image(1)]) != answer
    assert chat(llava_engine, [test_image(1), test_image(2)]) == answer


def test_same_image_and_seed_is_stable_at_default_temperature(llava_engine):
    """Sampling at temperature 1: the same images and seed give the same answer, another image another one."""
    first = chat(llava_engine, [test_image(4)], temperature=1.0, seed=11)
    assert chat(llava_engine, [test_image(4)], temperature=1.0, seed=11) == first
    assert chat(llava_engine, [test_image(5)], temperature=1.0, seed=11) != first


def test_images_reach_the_model(llava_engine):
    """Greedy decoding: the same images give the same answer, other images a different one."""
    first = chat(llava_engine, [test_image(1), test_image(2)])
    again = chat(llava_engine, [test_image(1), test_image(2)])
    other = chat(llava_engine, [test_image(3), test_image(4)])
    assert first == again
    assert other != first


def test_streaming(llava_engine):
    stream = llava_engine.client().chat.completions.create(
        **image_chat_kwargs([test_image(5), test_image(6)], model=llava_engine.name, stream=True)
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 1 and "".join(pieces).strip()


def test_mrv2_in_use(llava_engine):
    assert MRV2_LOG_LINE in llava_engine.log()


BAD_IMAGES = {
    "malformed-data-url": "data:image/png;base64,@@@not-base64@@@",
    "non-image-bytes": "data:image/png;base64," + base64.b64encode(b"plain text, not a PNG" * 10).decode(),
}


@pytest.mark.parametrize("name", BAD_IMAGES)
def test_bad_image_is_4xx_and_server_survives(llava_engine, name):
    client = llava_engine.client()
    error = expect_client_error(
        lambda: client.chat.completions.create(
            **image_chat_kwargs([BAD_IMAGES[name], test_image(1)], model=llava_engine.name)
        )
    )
    print(f"\n{name}: {error}")
    assert chat(llava_engine, [test_image(1), test_image(2)]).strip()


def test_unknown_model_is_404(llava_engine):
    client = llava_engine.client()
    expect_client_error(
        lambda: client.chat.completions.create(**image_chat_kwargs([test_image(1)], model="no-such-model")), {404}
    )
    assert chat(llava_engine, [test_image(1), test_image(2)]).strip()
