"""``python -m mmcpu.kernels check``: does every MRV2 kernel a serving request can reach have a native version whose
guard matches the installed vLLM, and will vLLM load the plugin that installs them? (:mod:`mmcpu.kernels.check`)

Prints one line per problem on stdout (``module:kernel: reason``) and exits 2; on success one line on stderr and
exit 0. Either way the kernels' result is kept for the engine's start (the stamp beside vLLM, when writable),
unless the plugin's entry point is missing (then every start runs the check again, and refuses).

With ``MMCPU_KERNELS=interpreter`` (how the proof line serves: its vLLM's kernels all run in Triton's interpreter)
no native version is asked for, as at the engine's start (:func:`mmcpu.launch.kernels_preflight`): only the
plugin's entry point is checked (in that mode the plugin fills the interpreter's gaps), the native guards are
skipped, and no stamp is written (a native start must not read a result that was never checked).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmcpu.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check"])
    parser.parse_args(argv)
    if "vllm" in sys.modules or "triton" in sys.modules:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("mmcpu.kernels check: vLLM / triton were imported before TRITON_INTERPRET=1 was set", file=sys.stderr)
            return 2
    # Kernels as the engine sees them (Triton's interpreter objects: patches/0004); vLLM's log lines off stdout,
    # which carries only the problem lines (mmcpu.launch.preflight reads them).
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from mmcpu.config import Settings
    from mmcpu.kernels import check

    if Settings().kernels == "interpreter":
        plugin = check.plugin_problems()
        for problem in plugin:
            print(problem.line(), flush=True)
        if plugin:
            return 2
        print(
            "mmcpu.kernels check: MMCPU_KERNELS=interpreter: every MRV2 kernel runs in Triton's interpreter, no "
            "native version checked (the plugin's entry point is registered)",
            file=sys.stderr,
        )
        return 0
    try:
        result = check.run()
        vdir = check.vllm_dir()
    except check.CheckError as exc:
        print(f"mmcpu.kernels: {exc}", flush=True)
        return 2
    # Stamped only with the plugin registered: a start that reads the stamp does not look at the entry point.
    plugin = check.plugin_problems()
    stamped = not plugin and check.write_stamp(vdir, result)
    problems = result.problems + plugin
    for problem in problems:
        print(problem.line(), flush=True)
    where = f"vLLM at {vdir}" + ("" if stamped or plugin else " (result not stamped: read-only)")
    if problems:
        print(
            f"mmcpu.kernels check: {len(problems)} problem(s) for {where}; MRV2 kernels a request can reach must "
            f"have a native version (mmcpu/kernels) whose guard matches, installed by mmcpu's vLLM plugin",
            file=sys.stderr,
        )
        return 2
    print(
        f"mmcpu.kernels check: all {result.reachable} reachable MRV2 kernels have a matching native version ({where})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
