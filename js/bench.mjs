// Latency of exported models in one onnxruntime for JavaScript (used by
// benchmarks/bench_onnx.py): median milliseconds per session.run ("groups") and
// every round's milliseconds ("rounds", which bench_onnx.py stores), the models
// of a group timed interleaved round by round so a load change hits all alike.
//
//   node bench.mjs --runtime node|web <manifest.json>
//
// manifest: {"repeats": 7, "warmup": 2, "groups": [{"id": "...", "models":
//   [{"id": "...", "file": "...", "feeds": {"query": {"dtype": "float32", "shape": [1, 128, 256]}}}]}]}
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { floatToHalf } from './safetensors.mjs';

const argv = process.argv.slice(2);
const runtime = argv[argv.indexOf('--runtime') + 1];
const manifestPath = argv.find((a, i) => i > 0 && argv[i - 1] !== '--runtime' && a !== '--runtime');
if (!['node', 'web'].includes(runtime) || !manifestPath) {
  console.error('usage: node bench.mjs --runtime node|web <manifest.json>');
  process.exit(2);
}
const ort = runtime === 'node' ? await import('onnxruntime-node') : await import('onnxruntime-web');
if (runtime === 'web') ort.env.wasm.numThreads = 1;
const manifest = JSON.parse(readFileSync(manifestPath, 'utf8'));
const root = dirname(manifestPath);

let seed = 1;
function random() {
  seed = (seed * 1103515245 + 12345) % 2147483648;
  return seed / 2147483648 - 0.5;
}

function feed(spec) {
  const size = spec.shape.reduce((a, b) => a * b, 1);
  if (spec.dtype === 'float32') return new ort.Tensor('float32', Float32Array.from({ length: size }, random), spec.shape);
  if (spec.dtype === 'float16') return new ort.Tensor('float16', Uint16Array.from({ length: size }, () => floatToHalf(random())), spec.shape);
  if (spec.dtype === 'bool') return new ort.Tensor('bool', new Uint8Array(size).fill(1), spec.shape);
  if (spec.dtype === 'int64') return new ort.Tensor('int64', BigInt64Array.from({ length: size }, (_, i) => BigInt(i % 7)), spec.shape);
  throw new Error(`unsupported dtype ${spec.dtype}`);
}

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const report = { runtime, versions: ort.env.versions, groups: {}, rounds: {} };
for (const group of manifest.groups) {
  const runs = [];
  for (const model of group.models) {
    const session = await ort.InferenceSession.create(readFileSync(join(root, model.file)));
    const feeds = Object.fromEntries(Object.entries(model.feeds).map(([name, spec]) => [name, feed(spec)]));
    runs.push({ id: model.id, run: () => session.run(feeds), times: [] });
  }
  for (let i = 0; i < (manifest.warmup ?? 2); i++) for (const r of runs) await r.run();
  for (let i = 0; i < manifest.repeats; i++) {
    for (const r of runs) {
      const start = performance.now();
      await r.run();
      r.times.push(performance.now() - start);
    }
  }
  report.groups[group.id] = Object.fromEntries(runs.map((r) => [r.id, median(r.times)]));
  report.rounds[group.id] = Object.fromEntries(runs.map((r) => [r.id, r.times]));
}
console.log(JSON.stringify(report));
