"""``export``/``build_model``: one DAMCHA layer as a validated ONNX model."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper

import damcha_core as dc
from damcha_core import DamchaConfig, DamchaValueError

from . import _io
from ._graph import (
    ATTENTION_OPSET,
    GraphBuilder,
    KVCacheNames,
    attention_layer,
    checked_arrays,
    checked_padding_mask,
)
from ._io import (
    DIGEST_KEY,
    EXTERNAL_DATA_MIN_BYTES,
    check_data_file,
    check_path,
    content_digest,
    data_file_name,
    needs_external_data,
    save_validated,
    set_metadata,
    validate_model,
)
from ._options import PAST_LEN, TOTAL_LEN, ExportOptions

#: Input/output names of an exported layer.
QUERY, CONTEXT, VALUE, MASK, OUTPUT, WEIGHTS = "query", "context", "value", "mask", "output", "weights"
#: Cache inputs/outputs of a ``kv_cache=True`` layer (stacks add ``.{layer}``).
PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE = "past_key", "past_value", "present_key", "present_value"


def cache_value_info(onnx_dtype: int, config: DamchaConfig, batch: str | int, suffix: str = "") -> tuple[list, list]:
    """(inputs, outputs) value infos of one layer's cache: past (B, G, P, d|d_v) -> present (B, G, P+N, d|d_v)."""
    G, d, d_v = config.num_kv_heads, config.key_dim, config.value_dim
    inputs = [
        helper.make_tensor_value_info(
            PAST_KEY + suffix,
            onnx_dtype,
            [batch, G, PAST_LEN, d],
            doc_string="cached keys k~ = L_k(c) k of the past_len earlier tokens, without the softmax scale "
            "(batch, kv_heads, past_len, key_dim); past_len 0 at the first step",
        ),
        helper.make_tensor_value_info(
            PAST_VALUE + suffix,
            onnx_dtype,
            [batch, G, PAST_LEN, d_v],
            doc_string="cached values of the past_len earlier tokens (batch, kv_heads, past_len, value_dim)",
        ),
    ]
    outputs = [
        helper.make_tensor_value_info(
            PRESENT_KEY + suffix,
            onnx_dtype,
            [batch, G, TOTAL_LEN, d],
            doc_string=f"{PAST_KEY + suffix} with this step's keys appended (batch, kv_heads, past_len + query_len, "
            f"key_dim): the next step's {PAST_KEY + suffix}",
        ),
        helper.make_tensor_value_info(
            PRESENT_VALUE + suffix,
            onnx_dtype,
            [batch, G, TOTAL_LEN, d_v],
            doc_string=f"{PAST_VALUE + suffix} with this step's values appended (batch, kv_heads, past_len + "
            f"query_len, value_dim): the next step's {PAST_VALUE + suffix}",
        ),
    ]
    return inputs, outputs


def cache_names(suffix: str = "") -> KVCacheNames:
    return KVCacheNames(PAST_KEY + suffix, PAST_VALUE + suffix, PRESENT_KEY + suffix, PRESENT_VALUE + suffix)


def mask_value_info(options: ExportOptions, heads: int) -> onnx.ValueInfoProto:
    """The boolean ``mask`` input, True = may attend: (B|1, H|1, N|1, M), or
    (B, M) for ``mask="padding"``."""
    B, N, M = options.batch_dim, options.query_dim, options.key_dim
    keys = "past_len + query_len" if options.kv_cache else "key_len"  # a decode step's keys: the cache's and its own
    if options.mask == "padding":
        dims = [B, M]
        doc = f"True = a real key token, False = padding (batch, {keys}), as a tokenizer's attention mask"
    elif options.dynamic:
        dims = ["mask_batch", "mask_heads", "mask_query", M]
        doc = f"True = may attend (batch|1, heads|1, query_len|1, {keys}|1), broadcast over the dims of size 1"
    else:
        dims = [B, heads, N, M]
        doc = f"True = may attend (batch, heads, query_len, {keys})"
    doc += "; a query that sees no key gets zero attention values"
    return helper.make_tensor_value_info(MASK, TensorProto.BOOL, dims, doc_string=doc)


def mask_node(g: GraphBuilder, options: ExportOptions, tokens: str, keys: str, past: str | None) -> str | None:
    """The graph value of the mask as (B|1, H|1, N|1, M), or ``None``.

    ``tokens`` is the input whose dim 0 is the batch, ``keys`` the one whose
    dim 1 counts the step's keys (the query or token ids, or the context),
    ``past`` the cache input whose dim 2 counts the cached keys, if any: a
    padding mask must be exactly (B, M) of these.
    """
    if not options.mask:
        return None
    if options.mask == "padding":
        key_len = g.dim(keys, 1, "padding_keys")
        if past is not None:
            key_len = g.op("Add", [g.dim(past, 2, "padding_past"), key_len], "padding_total")
        return checked_padding_mask(g, MASK, g.dim(tokens, 0, "padding_batch"), key_len)  # (B, 1, 1, M)
    return MASK


def weights_value_info(onnx_dtype: int, options: ExportOptions, heads: int, suffix: str = "") -> onnx.ValueInfoProto:
    """The ``weights`` output: attention probabilities (B, H, N, M)."""
    return helper.make_tensor_value_info(
        WEIGHTS + suffix,
        onnx_dtype,
        [options.batch_dim, heads, options.query_dim, options.key_dim],
        doc_string="attention probabilities"
        + (f" of layer {suffix[1:]}" if suffix else "")
        + f" (batch, heads, query_len, {'past_len + query_len' if options.kv_cache else 'key_len'})",
    )


def option_props(options: ExportOptions) -> dict[str, str]:
    """The model's metadata that says how it was exported: the dtype, the mask
    input's kind and whether attention probabilities are an output."""
    mask = "none" if not options.mask else ("padding" if options.mask == "padding" else "4d")
    return {
        "damcha_dtype": options.dtype_name,
        "damcha_mask": mask,
        "damcha_return_weights": str(options.return_weights),
    }


def ir_version_for(opset: int) -> int:
    """The oldest IR version that supports ``opset``: runtimes reject IRs newer than they know."""
    return helper.find_min_ir_version_for([helper.make_opsetid("", opset)])


@dataclasses.dataclass
class Draft:
    """A built graph whose initialisers are still NumPy arrays: assembled into
    a ModelProto with its weights inline, or referring to an external data
    file (a model over 2 GiB cannot be held as one protobuf message)."""

    g: GraphBuilder
    inputs: list
    outputs: list
    name: str
    doc: str
    props: dict[str, str]

    def model(self, location: str | None = None) -> tuple[onnx.ModelProto, list]:
        """(the ModelProto, the arrays to write to ``location`` in order)."""
        # The initialisers go into the model's own graph one at a time: make_graph and
        # make_model each copy what they are given, three copies of the weights at once.
        graph = helper.make_graph(self.g.nodes, self.name, self.inputs, self.outputs)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", self.g.opset)],
            producer_name="damcha_onnx",
            producer_version=dc.__version__,
            doc_string=self.doc,
        )
        model.ir_version = ir_version_for(self.g.opset)
        helper.set_model_props(model, self.props)
        # The identity of exactly this graph and these weights, so that a session
        # of another export with the same input names is told apart (run_ort).
        set_metadata(model, DIGEST_KEY, content_digest(model.SerializeToString(), self.g.arrays))
        external = self.g.add_initializers(model.graph, location, EXTERNAL_DATA_MIN_BYTES)
        return model, external

    def in_memory(self) -> onnx.ModelProto:
        """The ModelProto with every weight inline; refused over the size limit."""
        if self.g.nbytes > _io.EXTERNAL_DATA_THRESHOLD:
            raise DamchaValueError(
                f"This model has {self.g.nbytes} bytes of weights, too many for one protobuf message (2 GiB); "
                "export it to a file instead (export(..., path), saved with external data)."
            )
        return self.model()[0]


def check_paths(path: str | None, options: ExportOptions) -> None:
    """The data file of an export that asked for external data, before any work
    (``check_path`` has checked ``path`` itself)."""
    if path is not None and options.external_data:
        check_data_file(path)


def finish(draft: Draft, path: str | None, options: ExportOptions) -> onnx.ModelProto:
    """Validate the model, then write it to ``path`` (already checked) unless ``None``.

    With external data (``options.external_data``, or a model too large for
    one protobuf) the model is written and validated from disk; the returned
    ModelProto then refers to ``<path>.data`` (load it from ``path``).
    """
    if not needs_external_data(draft.g.nbytes, options.external_data):
        model = draft.in_memory()
        draft.g.arrays.clear()  # now held by the ModelProto: one copy of the weights, not two
        if path is None:
            validate_model(model)
        else:
            save_validated(model, path)  # validated from the written file, before it replaces path
        return model
    if path is None:
        raise DamchaValueError(
            dc.invalid_argument(
                "path",
                "a file path for a model saved with external data",
                f"path=None, external_data={options.external_data} ({draft.g.nbytes} bytes of weights)",
            )
        )
    check_data_file(path)  # before the file is written and validated (external_data=None decides here)
    model, arrays = draft.model(data_file_name(path))
    save_validated(model, path, arrays)
    return model


def _layer_model(params: Mapping[str, Any], config: DamchaConfig, options: ExportOptions) -> Draft:
    dc.check_config(config)
    params = checked_arrays(params, config)
    o = options
    dc.check_params_fit(params, o.dtype_name, float(np.finfo(o.dtype_name).max))
    if not o.cross and config.context_dim != config.query_dim:
        raise DamchaValueError(
            dc.invalid_argument(
                "config",
                "config.context_dim == config.query_dim without cross=True: a self-attention export reuses the "
                "query as context (pass cross=True for a separate context input)",
                f"query_dim={config.query_dim}, context_dim={config.context_dim}",
            )
        )
    # Value tokens of their own feature size (E_v != E_kv, DECISIONS 8) come in
    # as a third input; otherwise the values are the context's (or query's) tokens.
    separate_value = config.value_input_dim != config.context_dim
    if separate_value and not o.cross:
        raise DamchaValueError(
            dc.invalid_argument(
                "config",
                "config.value_input_dim == config.query_dim without cross=True: a self-attention export takes keys "
                "and values from the query (pass cross=True for separate context and value inputs)",
                f"query_dim={config.query_dim}, value_input_dim={config.value_input_dim}",
            )
        )
    B, N, M = o.batch_dim, o.query_dim, o.key_dim
    g = GraphBuilder(o.dtype_name, o.opset)
    query_doc = "query tokens x (batch, query_len, query_dim)"
    inputs = [
        helper.make_tensor_value_info(
            QUERY,
            g.onnx_dtype,
            [B, N, config.query_dim],
            doc_string=query_doc if o.cross else query_doc + "; keys and values are projected from them too",
        )
    ]
    outputs = [
        helper.make_tensor_value_info(
            OUTPUT,
            g.onnx_dtype,
            [B, N, config.output_dim],
            doc_string="attention output y (batch, query_len, output_dim)",
        )
    ]
    if o.cross:
        inputs.append(
            helper.make_tensor_value_info(
                CONTEXT,
                g.onnx_dtype,
                [B, M, config.context_dim],
                doc_string="context tokens c (batch, context_len, context_dim) that keys"
                + (" are" if separate_value else " and values are")
                + " projected from",
            )
        )
    if separate_value:
        inputs.append(
            helper.make_tensor_value_info(
                VALUE,
                g.onnx_dtype,
                [B, M, config.value_input_dim],
                doc_string="value tokens (batch, context_len, value_input_dim) that values are projected from",
            )
        )
    cache = None
    if o.kv_cache:
        cache_in, cache_out = cache_value_info(g.onnx_dtype, config, B)
        inputs += cache_in
        outputs += cache_out
        cache = cache_names()
    if o.mask:
        inputs.append(mask_value_info(o, config.num_heads))
    if o.return_weights:
        outputs.append(weights_value_info(g.onnx_dtype, o, config.num_heads))
    for value in inputs + outputs:
        g.reserve(value.name)
    y = attention_layer(
        g,
        params,
        config,
        QUERY,
        CONTEXT if o.cross else None,
        mask=mask_node(g, o, QUERY, CONTEXT if o.cross else QUERY, PAST_KEY if o.kv_cache else None),
        causal=o.causal,
        form=o.form,
        prefix="",
        cache=cache,
        weights=WEIGHTS if o.return_weights else None,
        value=VALUE if separate_value else None,
    )
    g.nodes.append(helper.make_node("Identity", [y], [OUTPUT], name="n_output"))
    doc = (
        f"DAMCHA v1 layer ({o.form} form, causal={o.causal}, kv_cache={o.kv_cache}); config: {config.to_dict()}. "
        "mask: True = may attend; a query with no visible key outputs output.bias."
    )
    if o.kv_cache:
        doc += (
            " Decode step: past_key (B, G, P, d) holds k~ = L_k(c) k (no softmax scale), query i sits at "
            "position P + i and sees keys j <= P + i; present_* = past_* with the new tokens appended."
        )
    props = {
        "damcha_config": json.dumps(config.to_dict(), sort_keys=True),
        "damcha_form": o.form,
        "damcha_causal": str(o.causal),
        "damcha_kv_cache": str(o.kv_cache),
        "damcha_cross": str(o.cross),
        **option_props(o),
    }
    return Draft(g, inputs, outputs, "damcha_attention", doc, props)


def build_model(
    params: Mapping[str, Any],
    config: DamchaConfig,
    *,
    opset: int = ATTENTION_OPSET,
    causal: bool = False,
    cross: bool = False,
    mask: bool | str = False,
    dynamic: bool = True,
    dtype: npt.DTypeLike = "float32",
    form: str = "auto",
    batch_size: int | None = None,
    query_len: int | None = None,
    context_len: int | None = None,
    kv_cache: bool = False,
    return_weights: bool = False,
    options: ExportOptions | None = None,
) -> onnx.ModelProto:
    """Build (without saving or validating) the ONNX model of one DAMCHA layer.

    Inputs of the model: ``query`` (B, N, E_q); ``context`` (B, M, E_kv) when
    ``cross``; ``value`` (B, M, E_v) when ``config.value_input_dim`` differs
    from ``context_dim`` (cross-attention only); with ``kv_cache``, ``past_key`` (B, G, P, d) and ``past_value``
    (B, G, P, d_v); ``mask`` bool (B|1, H|1, N|1, M), True = may attend, when
    ``mask`` (M = P + N with a cache), or (B, M) with ``mask="padding"``.
    Outputs: ``output`` (B, N, E_o), with ``kv_cache`` ``present_key``
    (B, G, P+N, d), ``present_value`` (B, G, P+N, d_v), with
    ``return_weights`` ``weights`` (B, H, N, M). See ``export`` for the arguments; ``options`` (an
    ``ExportOptions``) replaces them all.
    """
    options = ExportOptions.resolve(options, "layer", **ExportOptions.keywords(locals()))
    return _layer_model(params, config, options).in_memory()


def export(
    params: Mapping[str, Any],
    config: DamchaConfig,
    path: str | os.PathLike | None,
    *,
    opset: int = ATTENTION_OPSET,
    causal: bool = False,
    dynamic: bool = True,
    cross: bool = False,
    mask: bool | str = False,
    dtype: npt.DTypeLike = "float32",
    form: str = "auto",
    batch_size: int | None = None,
    query_len: int | None = None,
    context_len: int | None = None,
    kv_cache: bool = False,
    return_weights: bool = False,
    external_data: bool | None = None,
    options: ExportOptions | None = None,
) -> onnx.ModelProto:
    """Export one DAMCHA layer from canonical parameters to ONNX, validated.

    No deep-learning framework is involved: the graph is built with
    ``onnx.helper`` from the (float64) canonical params, then checked with
    ``onnx.checker.check_model(full_check=True)`` and strict shape inference.

    Args:
        params: canonical parameters (``config.param_shapes()``), any float dtype.
        config: the layer's ``DamchaConfig``.
        path: where to save the ``.onnx`` file; ``None`` only returns the model.
            Checked before any work; written atomically (a failed export
            leaves no partial file and keeps an earlier file at ``path``).
        opset: 17-22 export a decomposed MatMul/Softmax graph; >= 23 (default)
            one standard ``Attention`` op.
        causal: hide key j from query i when j > i (top-left, as the reference).
        dynamic: symbolic batch and sequence dims; ``False`` fixes them to
            ``batch_size``, ``query_len`` (and ``context_len``).
        cross: add a ``context`` (B, M, E_kv) input; otherwise self-attention.
            A config whose ``value_input_dim`` differs from ``context_dim``
            also gets a ``value`` (B, M, E_v) input (cross-attention only).
        mask: add a boolean ``mask`` input (B|1, H|1, N|1, M), True = may
            attend; ``mask="padding"`` a (B, M) key padding mask instead. A
            query row with no visible key outputs ``output.bias``.
        dtype: "float32" (default), "float64" or "float16" (or its NumPy
            dtype: ``np.float16``, ``np.dtype("float16")``) for inputs,
            weights and output; float16 accumulates the RMS statistic and the
            softmax in float32. bfloat16 is refused: onnxruntime's CPU
            provider has no bfloat16 kernels to validate it with.
        form: "auto" (by opset), "attention" or "decomposed" (also allowed at
            opset >= 23, e.g. for runtimes without an Attention kernel).
        kv_cache: export one step of incremental decoding (needs ``causal``,
            no ``cross``): extra inputs ``past_key`` (B, G, P, d) and
            ``past_value`` (B, G, P, d_v), P >= 0 tokens decoded before, and
            outputs ``present_key`` (B, G, P+N, d), ``present_value``
            (B, G, P+N, d_v). Query i of the step sits at position P + i and
            sees keys j <= P + i (bottom-right); the ``mask`` then has P + N
            columns. Cached keys are k~ = L_k(c) k in spec units, as in
            ``damcha_torch.DamchaKVCache``.
        return_weights: add an output ``weights`` (B, H, N, M), the attention
            probabilities (0 on a row with no visible key), as the reference's
            ``damcha_attention(..., return_weights=True)``.
        external_data: ``None`` (default) saves the weights inside the
            ``.onnx`` file unless the model passes protobuf's 2 GiB limit,
            then in ``<path>.data`` beside it (ONNX external data, which
            onnxruntime and ``onnx.load`` read from the ``.onnx`` path);
            ``True`` always does so; ``False`` never.
        options: an ``ExportOptions`` holding all of the above at once
            (then the keywords are not read).

    Returns:
        The validated ``onnx.ModelProto`` (also written to ``path``).

    Raises:
        DamchaValueError / DamchaTypeError: params not matching the config,
            opset out of range, inconsistent options, an unusable ``path``.
    """
    path = check_path(path)
    options = ExportOptions.resolve(options, "layer", **ExportOptions.keywords(locals()))
    check_paths(path, options)
    return finish(_layer_model(params, config, options), path, options)
