// Realtime transcription with OpenAI's official Node SDK, unmodified: OpenAIRealtimeWS (the `ws` transport), which
// connects only over wss, with the GA transcription intent.
// Usage: node realtime.mjs BASE_URL MODEL PCM16_24KHZ_FILE TURNS PACE
// Streams the raw 24 kHz PCM16 file in 100 ms appends at PACE times real time with server VAD, and prints one JSON
// line per server event, then {"end": {...}} once TURNS items are completed (or failed).
// OPENAI_NODE_MODULES names the node_modules folder holding the pinned `openai` and `ws` packages.
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const sdk = path.join(process.env.OPENAI_NODE_MODULES, "openai");
const { default: OpenAI } = await import(pathToFileURL(path.join(sdk, "index.mjs")).href);
const { OpenAIRealtimeWS } = await import(pathToFileURL(path.join(sdk, "realtime", "ws.mjs")).href);
const { VERSION } = await import(pathToFileURL(path.join(sdk, "version.mjs")).href);

const [baseURL, model, audioPath, turns, pace] = process.argv.slice(2);
const audio = fs.readFileSync(audioPath);
const CHUNK = 24000 * 2 / 10; // bytes of 100 ms
const client = new OpenAI({ baseURL, apiKey: process.env.OPENAI_API_KEY ?? "unused", maxRetries: 0 });
const rt = await OpenAIRealtimeWS.create(client, { intent: "transcription" });
const finals = [];
let deltas = 0;

const finish = (code) => {
  console.log(JSON.stringify({ end: { sdk: VERSION, url: rt.url.toString(), finals, deltas } }));
  rt.close();
  process.exit(code);
};
setTimeout(() => finish(2), 240_000);

rt.on("event", (event) => {
  console.log(JSON.stringify({ type: event.type, item_id: event.item_id ?? null }));
  if (event.type === "conversation.item.input_audio_transcription.delta") deltas += 1;
  if (event.type === "conversation.item.input_audio_transcription.completed"
      || event.type === "conversation.item.input_audio_transcription.failed") {
    finals.push(event.transcript ?? { failed: event.error });
    if (finals.length === Number(turns)) finish(0);
  }
});
rt.on("error", (err) => {
  console.log(JSON.stringify({ sdk_error: String(err.message ?? err) }));
  finish(1);
});
rt.socket.on("open", () => {
  rt.send({ type: "session.update", session: { type: "transcription", audio: { input: {
    format: { type: "audio/pcm", rate: 24000 }, transcription: { model }, turn_detection: { type: "server_vad" } } } } });
  let pos = 0;
  const start = Date.now();
  const tick = () => {
    if (pos >= audio.length) return;
    rt.send({ type: "input_audio_buffer.append", audio: audio.subarray(pos, pos + CHUNK).toString("base64") });
    pos += CHUNK;
    setTimeout(tick, Math.max(0, start + (pos / CHUNK) * 100 / Number(pace) - Date.now()));
  };
  tick();
});
