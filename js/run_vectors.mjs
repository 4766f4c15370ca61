// Runs damcha's exported ONNX models on the conformance test vectors in one
// onnxruntime for JavaScript, and reports each result as JSON on stdout.
//
//   node run_vectors.mjs --runtime node|web <manifest.json>
//
// The manifest (written by tests/test_onnx_js.py) lists runs: a model file,
// the vector case it is checked on (<case>.json + <case>.safetensors, as
// written by `damcha conform --export-vectors`), its dtype, and for decoding
// runs the token ranges fed step by step through the key/value cache. The
// expected values come from the vector files (a decoding run with `prefill`
// also compares its first step's outputs, the prefill's, with that tensor);
// nothing is computed here but
// the model's outputs and their distance to those values:
// |y - expected| <= atol + rtol |expected| with the case's tolerance for the
// run's dtype. A run with `weights` ({output, expected}) compares that output
// (the attention weights) too, with the same tolerance. Each run may list bad
// inputs, which must make the session throw (never return numbers).
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { halfToFloat, floatToHalf, readSafetensors } from './safetensors.mjs';

function parseArgs(argv) {
  const args = { runtime: null, manifest: null };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--runtime') args.runtime = argv[++i];
    else args.manifest = argv[i];
  }
  if (!['node', 'web'].includes(args.runtime) || !args.manifest) {
    console.error('usage: node run_vectors.mjs --runtime node|web <manifest.json>');
    process.exit(2);
  }
  return args;
}

async function loadRuntime(name) {
  if (name === 'node') return await import('onnxruntime-node');
  const ort = await import('onnxruntime-web');
  ort.env.wasm.numThreads = 1; // no worker threads: one WASM instance in this process
  return ort;
}

/** A stored tensor as an onnxruntime tensor of `dtype` (float inputs are cast). */
function toTensor(ort, stored, dtype) {
  const n = stored.data.length;
  if (dtype === 'float32') return new ort.Tensor('float32', Float32Array.from(stored.data), stored.shape);
  if (dtype === 'float16') {
    const bits = new Uint16Array(n);
    for (let i = 0; i < n; i++) bits[i] = floatToHalf(Number(stored.data[i]));
    return new ort.Tensor('float16', bits, stored.shape);
  }
  if (dtype === 'bool') return new ort.Tensor('bool', Uint8Array.from(stored.data, (v) => (v ? 1 : 0)), stored.shape);
  if (dtype === 'int64') return new ort.Tensor('int64', BigInt64Array.from(stored.data, (v) => BigInt(v)), stored.shape);
  throw new Error(`unsupported feed dtype ${dtype}`);
}

/** A tensor built from a bad-input spec: {dtype, shape, fill} or {dtype, shape, values}. */
function specTensor(ort, spec) {
  const size = spec.shape.reduce((a, b) => a * b, 1);
  const values = spec.values ?? new Array(size).fill(spec.fill ?? 0);
  return toTensor(ort, { data: values, shape: spec.shape }, spec.dtype);
}

/** Rows a..b of axis 1 of a stored (B, L, ...) tensor. */
function sliceAxis1(stored, a, b) {
  const [B, L, ...rest] = stored.shape;
  const inner = rest.reduce((x, y) => x * y, 1);
  const Type = stored.data.constructor;
  const out = new Type(B * (b - a) * inner);
  for (let i = 0; i < B; i++) {
    out.set(stored.data.subarray((i * L + a) * inner, (i * L + b) * inner), i * (b - a) * inner);
  }
  return { data: out, shape: [B, b - a, ...rest] };
}

/** Output tensors (B, n_k, ...) concatenated along axis 1, as plain numbers. */
function concatAxis1(parts) {
  const [B, , ...rest] = parts[0].dims;
  const inner = rest.reduce((x, y) => x * y, 1);
  const total = parts.reduce((s, p) => s + p.dims[1], 0);
  const out = new Float64Array(B * total * inner);
  let offset = 0;
  for (const p of parts) {
    const values = numbers(p);
    const n = p.dims[1];
    for (let i = 0; i < B; i++) {
      out.set(values.subarray(i * n * inner, (i + 1) * n * inner), (i * total + offset) * inner);
    }
    offset += n;
  }
  return { data: out, dims: [B, total, ...rest] };
}

function numbers(tensor) {
  if (tensor.type === 'float16' && !(typeof Float16Array !== 'undefined' && tensor.data instanceof Float16Array)) {
    return Float64Array.from(tensor.data, halfToFloat);
  }
  return Float64Array.from(tensor.data, Number);
}

function compare(actual, expected, tol) {
  const got = actual.data;
  if (actual.dims.length !== expected.shape.length || actual.dims.some((d, i) => d !== expected.shape[i])) {
    return { ok: false, error: `shape ${JSON.stringify(actual.dims)} != expected ${JSON.stringify(expected.shape)}` };
  }
  let maxErr = 0;
  let ratio = 0;
  for (let i = 0; i < got.length; i++) {
    const e = expected.data[i];
    // NaN in gives NaN out: non-finite exactly where the reference is (the Python runner's rule).
    if (Number.isFinite(got[i]) !== Number.isFinite(e)) {
      return { ok: false, error: `output at ${i} is ${got[i]} where the reference is ${e}` };
    }
    if (!Number.isFinite(e)) continue;
    const err = Math.abs(got[i] - e);
    maxErr = Math.max(maxErr, err);
    ratio = Math.max(ratio, err / (tol.atol + tol.rtol * Math.abs(e)));
  }
  return { ok: ratio <= 1, max_err: maxErr, ratio };
}

function emptyCache(ort, session, batch, dtype) {
  const cache = {};
  for (const meta of session.inputMetadata) {
    if (meta.name.startsWith('past_')) {
      const [, G, , d] = meta.shape;
      cache[meta.name] = new ort.Tensor(dtype, dtype === 'float16' ? new Uint16Array(0) : new Float32Array(0), [batch, G, 0, d]);
    }
  }
  return cache;
}

async function runOne(ort, root, run) {
  const description = JSON.parse(readFileSync(join(root, `${run.case}.json`), 'utf8'));
  const tensors = readSafetensors(join(root, description.tensors));
  const tol = description.tolerances[run.dtype];
  const session = await ort.InferenceSession.create(readFileSync(join(root, run.model)));
  const feedType = (name) => session.inputMetadata.find((m) => m.name === name).type;
  const firstFeeds = {};
  let result;
  if (!run.steps) {
    for (const [input, stored] of Object.entries(run.inputs)) {
      firstFeeds[input] = toTensor(ort, tensors[stored], feedType(input));
    }
    const out = await session.run(firstFeeds);
    result = compare({ data: numbers(out[run.output]), dims: out[run.output].dims }, tensors[run.expected], tol);
    if (run.weights) {
      const w = out[run.weights.output];
      const weights = compare({ data: numbers(w), dims: w.dims }, tensors[run.weights.expected], tol);
      result = { ...result, ok: result.ok && weights.ok, weights };
    }
  } else {
    // Decoding: each step's present_* become the next step's past_*.
    const source = tensors[run.inputs[run.step_input]];
    let cache = emptyCache(ort, session, source.shape[0], run.dtype);
    const outs = [];
    let prefill = null;
    for (const [k, [a, b]] of run.steps.entries()) {
      const feeds = { [run.step_input]: toTensor(ort, sliceAxis1(source, a, b), feedType(run.step_input)), ...cache };
      if (k === 0) Object.assign(firstFeeds, feeds);
      const out = await session.run(feeds);
      cache = {};
      for (const [name, value] of Object.entries(out)) {
        if (name.startsWith('present_')) cache[name.replace('present_', 'past_')] = value;
      }
      if (k >= run.keep_from_step) outs.push(out[run.output]);
      if (k === 0) prefill = out[run.output];
    }
    result = compare(concatAxis1(outs), tensors[run.expected], tol);
    if (run.prefill) {
      const checked = compare({ data: numbers(prefill), dims: prefill.dims }, tensors[run.prefill], tol);
      result = { ...result, ok: result.ok && checked.ok, prefill: checked };
    }
  }
  const bad = [];
  for (const spec of run.bad ?? []) {
    const feeds = { ...firstFeeds };
    for (const [input, t] of Object.entries(spec.feeds)) feeds[input] = specTensor(ort, t);
    try {
      const out = await session.run(feeds);
      bad.push({ run: run.id, name: spec.name, raised: false, output_dims: out[run.output].dims });
    } catch (err) {
      bad.push({ run: run.id, name: spec.name, raised: true, message: String(err.message ?? err).slice(0, 300) });
    }
  }
  return { result: { run: run.id, ...result }, bad };
}

const args = parseArgs(process.argv.slice(2));
const ort = await loadRuntime(args.runtime);
const manifest = JSON.parse(readFileSync(args.manifest, 'utf8'));
const root = dirname(args.manifest);
const report = { runtime: args.runtime, versions: ort.env.versions, results: [], bad: [] };
for (const run of manifest.runs) {
  const start = performance.now();
  try {
    const { result, bad } = await runOne(ort, root, run);
    report.results.push({ ...result, ms: Math.round(performance.now() - start) });
    report.bad.push(...bad);
  } catch (err) {
    report.results.push({ run: run.id, ok: false, error: String(err.message ?? err).slice(0, 500) });
  }
}
console.log(JSON.stringify(report));
process.exit(report.results.every((r) => r.ok) && report.bad.every((b) => b.raised) ? 0 : 1);
