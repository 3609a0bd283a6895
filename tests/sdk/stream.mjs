// A streamed transcription read by OpenAI's official Node SDK, unmodified: its `for await` loop over the events.
// Usage: node stream.mjs BASE_URL MODEL AUDIO_PATH [TEMPERATURE]
// Prints one JSON line per event ({type, delta} / {type, text, usage}), then {"end": ...} with what it read.
// OPENAI_NODE_MODULES names the node_modules folder that holds the SDK (the test installs a pinned `openai` there).
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const sdk = path.join(process.env.OPENAI_NODE_MODULES, "openai");
const { default: OpenAI, toFile } = await import(pathToFileURL(path.join(sdk, "index.mjs")).href);
const { VERSION } = await import(pathToFileURL(path.join(sdk, "version.mjs")).href);

const [baseURL, model, audioPath, temperature] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 300_000 });
const file = await toFile(fs.readFileSync(audioPath), path.basename(audioPath), { type: "audio/wav" });
const params = { file, model, stream: true };
if (temperature !== undefined) params.temperature = Number(temperature);

const stream = await client.audio.transcriptions.create(params);
let deltas = "";
let done = null;
for await (const event of stream) {
  if (event.type === "transcript.text.delta") {
    deltas += event.delta;
    console.log(JSON.stringify({ type: event.type, delta: event.delta }));
  } else if (event.type === "transcript.text.done") {
    done = event;
    console.log(JSON.stringify({ type: event.type, text: event.text, usage: event.usage }));
  } else {
    console.log(JSON.stringify({ type: event.type ?? null, unexpected: event }));
  }
}
console.log(JSON.stringify({ end: { sdk: VERSION, deltas, done_text: done?.text ?? null } }));
