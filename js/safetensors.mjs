// A minimal reader of safetensors files (the format of damcha's conformance
// vectors): an 8-byte little-endian header length, a JSON header of
// {name: {dtype, shape, data_offsets}}, then the raw little-endian tensors.
import { readFileSync } from 'node:fs';

const TYPES = {
  F64: Float64Array,
  F32: Float32Array,
  F16: Uint16Array, // float16 bits; see halfToFloat
  I64: BigInt64Array,
  I32: Int32Array,
  BOOL: Uint8Array,
  U8: Uint8Array,
};

/** Read every tensor of a safetensors file: {name: {dtype, shape, data}}. */
export function readSafetensors(path) {
  const bytes = readFileSync(path);
  const headerLength = Number(bytes.readBigUInt64LE(0));
  const header = JSON.parse(bytes.subarray(8, 8 + headerLength).toString('utf8'));
  const base = 8 + headerLength;
  const tensors = {};
  for (const [name, info] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const Type = TYPES[info.dtype];
    if (!Type) throw new Error(`${path}: tensor ${name} has unsupported dtype ${info.dtype}`);
    const [start, end] = info.data_offsets;
    // Copy: the payload offset need not be aligned for the typed array.
    const buffer = bytes.buffer.slice(bytes.byteOffset + base + start, bytes.byteOffset + base + end);
    tensors[name] = { dtype: info.dtype, shape: info.shape, data: new Type(buffer) };
  }
  return tensors;
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** float16 bits of a number, rounded to nearest even (through float32). */
export function floatToHalf(value) {
  f32[0] = value;
  const x = u32[0];
  const sign = (x >>> 16) & 0x8000;
  const exp = (x >>> 23) & 0xff;
  let mant = x & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0); // inf, NaN
  const e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00; // overflow to inf
  if (e <= 0) {
    if (e < -10) return sign; // underflow to zero
    mant |= 0x800000; // subnormal half
    const shift = 14 - e;
    let half = mant >>> shift;
    const rest = mant & ((1 << shift) - 1);
    const halfway = 1 << (shift - 1);
    if (rest > halfway || (rest === halfway && (half & 1))) half += 1;
    return sign | half;
  }
  let half = sign | (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (half & 1))) half += 1; // may carry into the exponent: still correct
  return half;
}

/** The number a float16 bit pattern holds. */
export function halfToFloat(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 0x1f) return mant ? NaN : sign * Infinity;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}
