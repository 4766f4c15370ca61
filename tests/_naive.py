"""An independent, deliberately naive DAMCHA and MHA written from the design note
with explicit Python loops: no einsum, no shared code with damcha_core. Tiny
shapes only."""

from __future__ import annotations

import math

import numpy as np


def _phi(t):
    return t / math.sqrt(sum(v * v for v in t) / len(t) + 1e-6)


def _apply(params, metric, side, token, y):
    """(L(t) y) for y of shape (S, d), token of shape (E,)."""
    if side is None:
        return y.copy()
    S, d = y.shape
    f = _phi(token)
    gate = params[f"metric.{side}.gate"]
    W = params[f"metric.{side}.kernel"]
    b = params[f"metric.{side}.bias"]
    out = y.copy()
    if metric == "heads":
        A = np.array(b, dtype=float)
        for e in range(len(f)):
            A = A + f[e] * W[e]
        for h in range(S):
            mix = np.zeros(d)
            for a in range(S):
                mix += A[h, a] * y[a]
            out[h] += gate[h] * mix
    else:
        U, V = params[f"metric.{side}.u"], params[f"metric.{side}.v"]
        r = W.shape[1]
        u = [sum(f[e] * W[e, k] for e in range(len(f))) + b[k] for k in range(r)]
        z = [sum(V[a, i, k] * y[a, i] for a in range(S) for i in range(d)) for k in range(r)]
        for h in range(S):
            for i in range(d):
                out[h, i] += gate[h] * sum(U[h, i, k] * u[k] * z[k] for k in range(r))
    return out


def _proj(params, name, token, use_bias):
    W = params[f"{name}.kernel"]
    out = np.tensordot(token, W, axes=(0, 0))
    return out + params[f"{name}.bias"] if use_bias else out


def naive_damcha(params, cfg, x, c=None, mask=None, causal=False, query_offset=0, v=None):
    """y (B, N, E_o) by loops over batch, tokens and heads; the values are
    projected from ``v`` (B, M, E_v) when given, else from the context."""
    c = x if c is None else c
    v_tokens = c if v is None else v
    B, N, _ = x.shape
    M = c.shape[1]
    H, G = cfg.num_heads, cfg.num_kv_heads
    per = H // G
    scale = cfg.scale if cfg.scale is not None else 1 / math.sqrt(cfg.key_dim)
    if cfg.metric == "none":
        sides = (None, None)
    else:
        sides = {"tied": ("qk", "qk"), "separate": ("q", "k"), "query": ("q", None)}[cfg.coupling]
    full_mask = None if mask is None else np.broadcast_to(mask, (B, H, N, M))
    y = np.zeros((B, N, cfg.output_dim))
    for b in range(B):
        q = [
            _apply(params, cfg.metric, sides[0], x[b, i], _proj(params, "query", x[b, i], cfg.use_bias))
            for i in range(N)
        ]
        k = [
            _apply(params, cfg.metric, sides[1], c[b, j], _proj(params, "key", c[b, j], cfg.use_bias)) for j in range(M)
        ]
        v = [_proj(params, "value", v_tokens[b, j], cfg.use_bias) for j in range(M)]
        for i in range(N):
            o = np.zeros((H, cfg.value_dim))
            for h in range(H):
                g = h // per
                vis = [
                    (full_mask is None or full_mask[b, h, i, j]) and (not causal or j <= i + query_offset)
                    for j in range(M)
                ]
                logits = [scale * float(np.dot(q[i][h], k[j][g])) for j in range(M)]
                top = max((lg for lg, ok in zip(logits, vis) if ok), default=None)
                if top is None:
                    continue  # no visible key: probabilities 0, output 0
                w = [math.exp(lg - top) if ok else 0.0 for lg, ok in zip(logits, vis)]
                total = sum(w)
                for j in range(M):
                    o[h] += (w[j] / total) * v[j][g]
            out = np.tensordot(o, params["output.kernel"], axes=([0, 1], [0, 1]))
            y[b, i] = out + params["output.bias"] if cfg.use_bias else out
    return y


def naive_metric_penalty(params, cfg, x, c=None):
    """mean over adapted roles of mean_t ||L(t) - I||_F^2 / (S d), with L(t) built
    column by column by applying the naive map to basis vectors."""
    c = x if c is None else c
    if cfg.metric == "none":
        return 0.0
    sides = {"tied": ("qk", "qk"), "separate": ("q", "k"), "query": ("q", None)}[cfg.coupling]
    d = cfg.key_dim
    per_role = []
    for side, tokens, S in ((sides[0], x, cfg.num_heads), (sides[1], c, cfg.num_kv_heads)):
        if side is None:
            continue
        values = []
        for b in range(tokens.shape[0]):
            for t in range(tokens.shape[1]):
                total = 0.0
                for a in range(S):
                    for j in range(d):
                        e = np.zeros((S, d))
                        e[a, j] = 1.0
                        col = _apply(params, cfg.metric, side, tokens[b, t], e) - e
                        total += float(np.sum(col * col))
                values.append(total / (S * d))
        per_role.append(sum(values) / len(values))
    return sum(per_role) / len(per_role)
