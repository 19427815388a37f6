"""Size checks of a ``--model`` before it is built: absurd options end in a clean error, not a MemoryError.

Building a zoo model allocates host memory for the constants it embeds (the Transformer's position
encodings and causal mask grow with ``seq_len**2``), takes time in proportion to its op count, and a
GraphDef cannot exceed 2 GiB. ``check_model_spec`` estimates, from the options alone and without
TensorFlow, the embedded constant bytes, the op count, the variable bytes and the largest activation of a
``zoo:NAME,key=value`` spec, and raises TagError naming the option when one is beyond reason. A path to a
GraphDef file is bounded by its file size (``tag.files.read_input_file``), so only zoo specs are
estimated here. The figures are estimates (within a few percent for the default models), used only for
these limits.

Example::

    from tag.cli.model_size import check_model_spec, estimate_zoo
    check_model_spec("zoo:transformer,seq_len=100000000", batch=32)
    # TagError: zoo:transformer,seq_len=100000000: the model would embed about 745.1 GiB of constants ...
    estimate_zoo("mlp", 32, {})["parameter_bytes"]      # about 23.3 MB
"""
from __future__ import annotations

from itertools import pairwise
from typing import Any

from tag.errors import TagError

MAX_CONSTANT_BYTES = 1 << 30        # host memory while building; a GraphDef holds at most 2 GiB
MAX_OPS = 300_000                   # bert_large has about 12,000
MAX_TENSOR_BYTES = 1 << 50          # 1 PiB: more than any cluster holds; a typo, not a model
_F32 = 4

_DEFAULTS: dict[str, dict[str, Any]] = {
    "mlp": {"input_dim": 784, "hidden": (2048, 2048), "num_classes": 10},
    "transformer": {"seq_len": 64, "vocab_size": 37000, "num_layers": 6, "d_model": 512, "d_ff": 2048,
                    "num_heads": 8},
    "bert_base": {"seq_len": 128, "vocab_size": 30522, "num_layers": 12, "hidden_size": 768, "num_heads": 12,
                  "intermediate_size": 3072, "max_position": 512, "type_vocab_size": 2, "num_classes": 2},
    "bert_large": {"seq_len": 128, "vocab_size": 30522, "num_layers": 24, "hidden_size": 1024, "num_heads": 16,
                   "intermediate_size": 4096, "max_position": 512, "type_vocab_size": 2, "num_classes": 2},
}
# Keras CNNs: (default image size, parameters at 1000 classes, classifier input width, ops,
# activation bytes per image pixel per example at the widest layer, classifier params per pixel)
_CNNS: dict[str, tuple[int, int, int, int, int, float]] = {
    "vgg19": (224, 143_667_240, 4096, 450, 64 * _F32, 102_760_448 / 224 ** 2),
    "resnet50": (224, 25_583_592, 2048, 2950, 64 * _F32, 0.0),
    "inception_v3": (299, 23_817_352, 2048, 4100, 64 * _F32, 0.0),
    "mobilenet_v2": (224, 3_504_872, 1280, 2420, 96 * _F32, 0.0),
}


def _num(value: Any, default: Any) -> Any:
    return default if value is None else value


def _parse(spec: str) -> tuple[str, dict[str, Any]] | None:
    """(name, options) of a zoo spec, numbers parsed as the zoo parses them; None if not a zoo spec or if
    an option is not a plain number (the zoo reports those itself)."""
    spec = spec.strip()
    if not spec.startswith("zoo:"):
        return None
    name, *pairs = spec[4:].split(",")
    options: dict[str, Any] = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        text = text.strip()
        try:
            if "x" in text:
                options[key.strip()] = tuple(int(part) for part in text.split("x"))
            else:
                options[key.strip()] = int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            return None
    return name.strip(), options


def estimate_zoo(name: str, batch: int, options: dict[str, Any]) -> dict[str, float] | None:
    """Estimated ``constant_bytes``, ``ops``, ``parameter_bytes`` and ``activation_bytes`` (largest
    activation) of zoo model NAME at global batch BATCH with OPTIONS; None for an unknown model."""
    if name in _CNNS:
        size0, params, width, ops, per_pixel, fc_per_pixel = _CNNS[name]
        size = int(_num(options.get("image_size"), size0))
        classes = int(options.get("num_classes", 1000))
        params = params + (classes - 1000) * (width + 1) + fc_per_pixel * (size ** 2 - size0 ** 2)
        return {"constant_bytes": 0.0, "ops": float(ops), "parameter_bytes": float(params) * _F32,
                "activation_bytes": float(batch) * size * size * per_pixel}
    if name not in _DEFAULTS:
        return None
    o = {**_DEFAULTS[name], **options}
    if name == "mlp":
        hidden = o["hidden"] if isinstance(o["hidden"], tuple) else (o["hidden"],)
        widths = [int(o["input_dim"]), *map(int, hidden), int(o["num_classes"])]
        params = sum(a * b + b for a, b in pairwise(widths))
        return {"constant_bytes": 0.0, "ops": 40.0 * len(widths) + 50, "parameter_bytes": float(params) * _F32,
                "activation_bytes": float(batch) * max(widths) * _F32}
    layers, s = int(o["num_layers"]), int(o["seq_len"])
    if name == "transformer":
        d, f, heads = int(o["d_model"]), int(o["d_ff"]), int(o["num_heads"])
        params = int(o["vocab_size"]) * d + layers * (12 * d * d + 4 * d * f)
        # position encodings (float64 while computed, float32 kept) and the causal mask (built twice)
        consts = s * d * (8 * 2 + _F32) + s * s * 3 * _F32
        return {"constant_bytes": float(consts), "ops": 1000.0 * layers + 500, "parameter_bytes": float(params) * _F32,
                "activation_bytes": float(batch) * heads * s * s * _F32}
    h, inter, heads = int(o["hidden_size"]), int(o["intermediate_size"]), int(o["num_heads"])
    params = (int(o["vocab_size"]) + int(o["max_position"]) + int(o["type_vocab_size"])) * h \
        + layers * (4 * h * h + 2 * h * inter)
    return {"constant_bytes": 0.0, "ops": 500.0 * layers + 300, "parameter_bytes": float(params) * _F32,
            "activation_bytes": float(batch) * heads * s * s * _F32}


def _gib(b: float) -> str:
    return f"{b / 2 ** 30:.1f} GiB"


def check_model_spec(spec: str, batch: int | None) -> None:
    """Raise TagError when zoo spec SPEC at global batch BATCH (None: the zoo's default) is beyond the
    limits (``MAX_CONSTANT_BYTES``, ``MAX_OPS``, ``MAX_TENSOR_BYTES``); do nothing for a file path."""
    parsed = _parse(str(spec))
    if parsed is None:
        return
    name, options = parsed
    if any(isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 for v in options.values()
           if not isinstance(v, tuple)):
        return      # the zoo names the option that must be positive
    try:
        est = estimate_zoo(name, 32 if batch is None else int(batch), options)
    except (TypeError, ValueError, OverflowError):
        return
    if est is None:
        return
    if est["constant_bytes"] > MAX_CONSTANT_BYTES:
        raise TagError(f"{spec}: the model would embed about {_gib(est['constant_bytes'])} of constants "
                       f"(limit {_gib(MAX_CONSTANT_BYTES)}; a GraphDef holds at most 2 GiB): reduce seq_len")
    if est["ops"] > MAX_OPS:
        raise TagError(f"{spec}: the model would have about {est['ops']:,.0f} ops (limit {MAX_OPS:,}): "
                       f"reduce num_layers or the number of hidden layers")
    for key, what in (("parameter_bytes", "variables"), ("activation_bytes", "its largest activation")):
        if est[key] > MAX_TENSOR_BYTES:
            raise TagError(f"{spec}: {what} would take about {est[key] / 2 ** 50:.3g} PiB "
                           f"(limit 1 PiB): check the options and --batch-size")
