// Greedy decoding with a DAMCHA token model exported with kv_cache=True:
//   node example.mjs model.onnx '[3, 1, 4]' 5
import * as ort from 'onnxruntime-web'; // or 'onnxruntime-node': the same API
import { readFileSync } from 'node:fs';

ort.env.wasm.numThreads = 1;
const session = await ort.InferenceSession.create(readFileSync(process.argv[2]));
const ids = JSON.parse(process.argv[3]); // the prompt
const steps = Number(process.argv[4]); // tokens to generate

// The first step's cache is empty: past_key.{i} / past_value.{i} of shape (1, G, 0, d),
// in the model's own type (float16 data is held as raw bits in a Uint16Array).
const ARRAYS = { float32: Float32Array, float16: Uint16Array, float64: Float64Array };
let cache = {};
for (const { name, type, shape } of session.inputMetadata) {
  if (name.startsWith('past_')) cache[name] = new ort.Tensor(type, new ARRAYS[type](0), [1, shape[1], 0, shape[3]]);
}
// A float16 value from its bits (Node.js 20 has no Float16Array).
const half = (h) => {
  const exp = (h >> 10) & 31, frac = h & 1023, sign = h & 0x8000 ? -1 : 1;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (exp ? (1 + frac / 1024) * 2 ** (exp - 15) : frac * 2 ** -24);
};
let feed = ids; // the prompt in one step, then one token per step
for (let step = 0; step < steps; step++) {
  const tokens = new ort.Tensor('int64', BigInt64Array.from(feed, BigInt), [1, feed.length]);
  const out = await session.run({ tokens, ...cache });
  cache = {}; // present_key.{i} -> past_key.{i} of the next step
  for (const [name, value] of Object.entries(out)) {
    if (name.startsWith('present_')) cache[name.replace('present_', 'past_')] = value;
  }
  const [, n, classes] = out.logits.dims; // (1, n, C): the next token from the last position
  const row = out.logits.data.subarray((n - 1) * classes, n * classes);
  // float16 logits are raw bits, unless the engine has Float16Array (then onnxruntime uses it).
  const last = out.logits.type === 'float16' && row instanceof Uint16Array ? Array.from(row, half) : Array.from(row);
  feed = [last.indexOf(Math.max(...last))];
  ids.push(feed[0]);
}
console.log(JSON.stringify(ids));
