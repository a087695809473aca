"""Load a K3 checkpoint into a model shard: each rank reads only its own slices.

Parameter `p` (module path `n`) takes checkpoint tensor `language_model.n`, sliced by the
parameter's `shard_fn(full, par)` when it has one, else 1/TP along `shard_dim` (rank r: the
r-th contiguous chunk, read with safetensors `get_slice`, so other ranks' bytes are never
read). Routed experts: expert e's checkpoint tensors are `...experts.{e}.w1.weight_packed` +
`.weight_scale` (MXFP4) or `.weight`, stacked over e into the model's parameters:
  MXFP4-resident (models/moe.py): `w13_packed` / `w13_scale` (E, 2, I, ·) = [w1; w3] packed
    bytes / scales, `w2_packed` / `w2_scale` (E, L, ·), copied as stored (never dequantized);
  model dtype: `w1|w3` (E, I, L), `w2` (E, L, I); MXFP4 tensors are unpacked into them.
A split of I slices the rows of w1/w3 and the K columns of w2; a split along K must cover whole
groups of 32 (I/TP % 32 == 0). Scale bytes above kernels/moe_mxfp4.py `MAX_SCALE` (255 = NaN)
are refused.

Any other linear the quantization_config names MXFP4 (`.weight_packed` + `.weight_scale`) is
read as stored and decoded into the model dtype (a slice along K must be whole groups of 32);
those parameters then hold exactly the MXFP4 values.

Published layouts, mapped onto the one above as they are read (`_canonical`): decoder layers
under `language_model.layers.*` as well as `language_model.model.layers.*`, and KDA `A_log` of
shape (num_heads,), (1, 1, num_heads, 1) or (max(head_dim, num_heads),) (tail zero padded).

Strict: any mismatch between checkpoint, config and model is a `CheckpointError` naming the
tensor or file, raised before any parameter is written where it can be seen from the headers.
Only the multimodal checkpoint's `vision_tower.*` / `mm_projector.*` tensors are skipped.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from raydecode.kernels.moe_mxfp4 import MAX_SCALE

from .checkpoint import (INDEX_FILE, LAYER_PREFIXES, PREFIX, CheckpointError, TensorSpec,
                         checkpoint_tensor_specs, make_tensor, with_test_tokenizer_ids)
from .config import PRESETS, K3Config, load_config
from .mxfp4 import GROUP_SIZE, SCALE_BIAS, unpack_mxfp4
from .parallel import Comm, LocalComm, Parallel

__all__ = ["load_weights", "load_model", "read_index", "CheckpointError"]

_EXPERTS = re.compile(r"(?P<mod>.+\.experts)\.(?P<w>w[123]|w13_packed|w13_scale|w2_packed"
                      r"|w2_scale)$")
# MXFP4-resident parameter -> (checkpoint linears stacked per expert, tensor suffix)
_RESIDENT = {"w13_packed": (("w1", "w3"), "weight_packed"),
             "w13_scale": (("w1", "w3"), "weight_scale"),
             "w2_packed": (("w2",), "weight_packed"), "w2_scale": (("w2",), "weight_scale")}
# the published K3 checkpoint is multimodal; this text engine leaves its vision parts unread
NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.")
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F64": torch.float64, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
              "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


# ---- where tensors come from -----------------------------------------------------------------

class _Source:
    """name -> (shape, dtype) from headers, and `read(name, dim, start, size)` of one slice."""

    def __init__(self, headers: dict[str, tuple[tuple[int, ...], object]],
                 reader: Callable[[str, tuple], torch.Tensor]):
        self.headers, self._reader = headers, reader

    def read(self, name: str, dim: int | None = None, start: int = 0,
             size: int | None = None) -> torch.Tensor:
        if dim is None:
            return self._reader(name, (slice(None),))
        idx = (slice(None),) * dim + (slice(start, start + size),)
        return self._reader(name, idx)


def read_index(ckpt_dir: str | Path) -> dict[str, str]:
    """weight_map of `model.safetensors.index.json` (or of a lone `model.safetensors`)."""
    d = Path(ckpt_dir)
    path = d / INDEX_FILE
    if not path.is_file():
        single = d / "model.safetensors"
        if single.is_file():
            from safetensors import safe_open
            with safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), single.name)
        raise CheckpointError(f"{d}: no {INDEX_FILE} and no model.safetensors")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in wm.items()):
        raise CheckpointError(f"{path}: expected {{'metadata': ..., 'weight_map': {{tensor name:"
                              f" shard file}}}}, got top-level keys "
                              f"{sorted(index) if isinstance(index, dict) else type(index)}")
    return wm


def _file_source(ckpt_dir: Path) -> _Source:
    from safetensors import safe_open

    weight_map = read_index(ckpt_dir)
    handles, headers = {}, {}
    for fname in sorted(set(weight_map.values())):
        fpath = ckpt_dir / fname
        if not fpath.is_file():
            held = [n for n, f in weight_map.items() if f == fname]
            raise CheckpointError(f"shard file {fpath} named in {INDEX_FILE} is missing (it "
                                  f"should hold {len(held)} tensors, e.g. {held[0]})")
        handles[fname] = f = safe_open(str(fpath), framework="pt", device="cpu")
        for n in f.keys():
            if weight_map.get(n) != fname:
                where = f"maps to {weight_map[n]}" if n in weight_map else "does not list"
                raise CheckpointError(f"{fpath} holds tensor {n!r}, which {INDEX_FILE} {where}")
            sl = f.get_slice(n)
            headers[n] = (tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
    absent = [n for n in weight_map if n not in headers]
    if absent:
        raise CheckpointError(f"{INDEX_FILE} maps {absent[0]!r} to {weight_map[absent[0]]}, "
                              f"which does not contain it ({len(absent)} such tensors)")
    return _Source(headers, lambda n, idx: handles[weight_map[n]].get_slice(n)[idx])


def _canonical(src: _Source, cfg: K3Config) -> _Source:
    """`src` under the names and shapes `checkpoint_tensor_specs` uses: `language_model.layers.`
    renamed `language_model.model.layers.`, KDA `A_log` (1, 1, H, 1) read as (H,)."""
    canon, alt = LAYER_PREFIXES
    H = cfg.kda.num_heads
    names: dict[str, str] = {}                     # canonical name -> stored name
    headers = {}
    for n, (shape, dtype) in src.headers.items():
        c = canon + n[len(alt):] if n.startswith(alt) else n
        if c in names:
            raise CheckpointError(f"the checkpoint holds {names[c]!r} and {n!r}: one tensor "
                                  "under both layer prefixes")
        if c.endswith(".A_log") and shape == (1, 1, H, 1):
            shape = (H,)
        names[c], headers[c] = n, (shape, dtype)
    if all(c == n and headers[c] == src.headers[n] for c, n in names.items()):
        return src

    def reader(c: str, idx) -> torch.Tensor:
        n = names[c]
        if src.headers[n][0] != headers[c][0]:        # A_log (1, 1, H, 1) -> (H,)
            return src.read(n).reshape(headers[c][0])[idx]
        return src._reader(n, idx)

    return _Source(headers, reader)


def _random_source(cfg: K3Config, seed: int) -> _Source:
    """The tensors `write_checkpoint(cfg, seed=seed)` would write, made on demand."""
    specs = checkpoint_tensor_specs(cfg)
    cache: dict[str, torch.Tensor] = {}

    def reader(n: str, idx) -> torch.Tensor:
        if n not in cache:
            cache.clear()        # one tensor at a time (packed/scale of one expert repeat)
            cache[n] = make_tensor(cfg, n, seed, specs)
        return cache[n][idx]

    return _Source({n: (s.shape, s.dtype) for n, s in specs.items()}, reader)


# ---- checks --------------------------------------------------------------------------------

def _check_headers(src: _Source, specs: dict[str, TensorSpec], cfg: K3Config) -> None:
    unknown = [n for n in src.headers if n not in specs and not n.startswith(NON_TEXT_PREFIXES)]
    if unknown:
        kinds = "".join(k[0] for k in cfg.layer_kinds)
        raise CheckpointError(f"unknown tensor(s) in the checkpoint: {unknown[:5]} "
                              f"({len(unknown)} in all); its config.json ({cfg.num_layers} "
                              f"layers, kinds {kinds}) implies no such tensor")
    missing = [n for n in specs if n not in src.headers]
    if missing:
        raise CheckpointError(f"the checkpoint lacks tensor(s) {missing[:5]} ({len(missing)} "
                              f"in all) that its config.json implies")
    H = cfg.kda.num_heads
    for n, spec in specs.items():
        shape, dtype = src.headers[n]
        if n.endswith(".A_log") and shape == (H,) and dtype == spec.dtype:
            continue            # one value per head; the padded (max(head_dim, H),) form too
        if n.endswith(".weight_scale") and len(shape) == 2 and shape[0] == spec.shape[0] \
                and shape[1] != spec.shape[1]:
            k = spec.shape[1] * GROUP_SIZE
            raise CheckpointError(f"{n}: MXFP4 scales have {shape[1]} columns for K = {k} "
                                  f"(group size {k / shape[1]:g}); group size {GROUP_SIZE} "
                                  f"needs K/32 = {spec.shape[1]} columns")
        if shape != spec.shape:
            raise CheckpointError(f"{n}: shape {shape} in the checkpoint, expected {spec.shape}")
        if spec.dtype == torch.uint8 and dtype != torch.uint8:
            raise CheckpointError(f"{n}: dtype {dtype}, MXFP4 data must be uint8")
        if spec.dtype != torch.uint8 and not (isinstance(dtype, torch.dtype)
                                              and dtype.is_floating_point):
            raise CheckpointError(f"{n}: dtype {dtype}, expected a float tensor "
                                  f"({spec.dtype} in K3)")


def _plan(model: nn.Module, specs: dict[str, TensorSpec], cfg: K3Config):
    """[(param name, param, checkpoint names, full shape)] covering every spec exactly once,
    each parameter's `full_shape` checked against the checkpoint."""
    plan, used = [], set()
    for pname, p in model.named_parameters():
        m = _EXPERTS.match(pname)
        if m and m["w"] in _RESIDENT:
            lins, suffix = _RESIDENT[m["w"]]
            names = [f"{PREFIX}{m['mod']}.{e}.{w}.{suffix}"
                     for e in range(cfg.moe.num_experts) for w in lins]
        elif m:
            names = []
            for e in range(cfg.moe.num_experts):
                mod = f"{PREFIX}{m['mod']}.{e}.{m['w']}"
                names += ([f"{mod}.weight_packed", f"{mod}.weight_scale"]
                          if f"{mod}.weight_packed" in specs else [f"{mod}.weight"])
        elif pname.endswith(".weight") and f"{PREFIX}{pname[:-7]}.weight_packed" in specs:
            mod = f"{PREFIX}{pname[:-7]}"              # an MXFP4 linear other than the experts
            names = [f"{mod}.weight_packed", f"{mod}.weight_scale"]
        else:
            names = [PREFIX + pname]
        absent = [n for n in names if n not in specs]
        if absent:
            raise CheckpointError(f"model parameter {pname!r} has no tensor in the checkpoint "
                                  f"(expected {absent[0]!r})")
        full = specs[names[0]].shape
        if m and m["w"] in _RESIDENT:   # stored units (bytes / groups), [w1; w3] on dim 1
            n_lin = len(_RESIDENT[m["w"]][0])
            full = (cfg.moe.num_experts,) + ((2,) if n_lin == 2 else ()) + full
        elif m:   # stacked (E, rows, K); a packed byte holds two K values
            rows, cols = full
            packed = names[0].endswith(".weight_packed")
            full = (cfg.moe.num_experts, rows, 2 * cols if packed else cols)
        elif names[0].endswith(".weight_packed"):     # (N, K/2) bytes -> the (N, K) weight
            full = (full[0], 2 * full[1])
        want = getattr(p, "full_shape", None)
        if want is not None and tuple(want) != full:
            raise CheckpointError(f"{names[0]}: the checkpoint gives parameter {pname!r} the "
                                  f"full shape {full}, the parameter expects {tuple(want)}")
        plan.append((pname, p, names, full))
        used.update(names)
    unused = [n for n in specs if n not in used]
    if unused:
        raise CheckpointError(f"checkpoint tensor(s) {unused[:5]} ({len(unused)} in all) match "
                              "no parameter of the model")
    return plan


# ---- loading -------------------------------------------------------------------------------

def _chunk(n: int, par: Parallel, what: str) -> tuple[int, int]:
    if n % par.tp_size:
        raise CheckpointError(f"{what}: size {n} is not divisible by tensor_parallel_size "
                              f"{par.tp_size}")
    size = n // par.tp_size
    return par.tp_rank * size, size


def _load_dense(pname: str, p: nn.Parameter, name: str, shape: tuple[int, ...], src: _Source,
                par: Parallel) -> None:
    fn, dim = getattr(p, "shard_fn", None), getattr(p, "shard_dim", None)
    if fn is not None:
        t = fn(src.read(name), par)
    elif dim is None or par.tp_size == 1:
        t = src.read(name)
    else:
        start, size = _chunk(shape[dim], par, f"{name} dim {dim}")
        t = src.read(name, dim, start, size)
    if tuple(t.shape) != tuple(p.shape):
        raise CheckpointError(f"{name}: rank {par.tp_rank}/{par.tp_size} slice has shape "
                              f"{tuple(t.shape)}, parameter {pname!r} has {tuple(p.shape)}")
    p.data.copy_(t)


def _load_dense_mxfp4(pname: str, p: nn.Parameter, names: list[str], full: tuple[int, int],
                      src: _Source, par: Parallel) -> None:
    """A linear stored MXFP4 (packed (N, K/2) + scales (N, K/32)): this rank's slice of rows
    (column-parallel) or of K (row-parallel, whole groups of 32), decoded into p's dtype."""
    pk, sc = names
    rows, cols = full
    dim = getattr(p, "shard_dim", None)
    if getattr(p, "shard_fn", None) is not None:
        raise CheckpointError(f"{pk}: parameter {pname!r} has a custom slice; it cannot be "
                              "read from MXFP4")
    if dim is None or par.tp_size == 1:
        packed, scales = src.read(pk), src.read(sc)
    elif dim == 0:
        start, size = _chunk(rows, par, f"{pk} rows")
        packed, scales = src.read(pk, 0, start, size), src.read(sc, 0, start, size)
    else:
        start, size = _chunk(cols, par, f"{pk} K")
        if start % GROUP_SIZE or size % GROUP_SIZE:
            raise CheckpointError(f"{pname}: tensor_parallel_size {par.tp_size} splits K = "
                                  f"{cols} into {size}-wide slices; MXFP4 slices must be whole "
                                  f"groups of {GROUP_SIZE} (K/TP a multiple of {GROUP_SIZE})")
        packed = src.read(pk, 1, start // 2, size // 2)
        scales = src.read(sc, 1, start // GROUP_SIZE, size // GROUP_SIZE)
    _check_scales(sc, scales)
    w = unpack_mxfp4(packed, scales, torch.float32)
    if tuple(w.shape) != tuple(p.shape):
        raise CheckpointError(f"{pk}: rank {par.tp_rank}/{par.tp_size} slice decodes to "
                              f"{tuple(w.shape)}, parameter {pname!r} has {tuple(p.shape)}")
    p.data.copy_(w)


def _load_experts(pname: str, p: nn.Parameter, names: list[str], full: tuple[int, int, int],
                  src: _Source, par: Parallel) -> None:
    quant = names[0].endswith(".weight_packed")
    per = 2 if quant else 1                       # checkpoint tensors per expert
    n_exp, rows, cols = full
    dim = getattr(p, "shard_dim", None)
    experts, r0, nr, c0, nc = range(n_exp), 0, rows, 0, cols
    if dim is not None and par.tp_size > 1:
        start, size = _chunk(full[dim], par, f"{pname} dim {dim}")
        if dim == 0:
            experts = range(start, start + size)
        elif dim == 1:
            r0, nr = start, size
        else:
            c0, nc = start, size
            if quant and (start % GROUP_SIZE or size % GROUP_SIZE):
                raise CheckpointError(
                    f"{pname}: tensor_parallel_size {par.tp_size} splits K = {cols} into "
                    f"{size}-wide slices; MXFP4 slices must be whole groups of {GROUP_SIZE} "
                    f"(K/TP a multiple of {GROUP_SIZE})")
    want = (len(experts), nr, nc)
    if tuple(p.shape) != want:
        raise CheckpointError(f"{pname}: rank {par.tp_rank}/{par.tp_size} slice of the experts "
                              f"is {want}, the parameter has {tuple(p.shape)}")
    for i, e in enumerate(experts):
        if quant:
            pk, sc = names[per * e], names[per * e + 1]
            if c0 or nc != cols:
                packed = src.read(pk, 1, c0 // 2, nc // 2)
                scales = src.read(sc, 1, c0 // GROUP_SIZE, nc // GROUP_SIZE)
            else:
                packed, scales = src.read(pk, 0, r0, nr), src.read(sc, 0, r0, nr)
            p.data[i].copy_(unpack_mxfp4(packed, scales, torch.float32))
        else:
            w = names[e]
            p.data[i].copy_(src.read(w, 1, c0, nc) if nc != cols else src.read(w, 0, r0, nr))


def _check_scales(name: str, scales: torch.Tensor) -> None:
    hi = int(scales.max()) if scales.numel() else 0
    if hi > MAX_SCALE:
        what = "NaN in ue8m0" if hi == 255 else f"2**{hi - SCALE_BIAS}"
        raise CheckpointError(f"{name}: MXFP4 scale byte {hi} ({what}); the MXFP4 expert "
                              f"kernels decode scale bytes up to {MAX_SCALE}")


def _load_resident(pname: str, p: nn.Parameter, names: list[str], full: tuple[int, ...],
                   src: _Source, par: Parallel) -> None:
    """MXFP4 bytes / scales as stored: `full` (E, 2, I, cols) for [w1; w3] (names: e-major,
    w1 then w3) split along the rows I, or (E, L, cols) for w2 split along K = I (columns
    hold 2 K values when packed, 32 when scales)."""
    n_exp, (rows, cols) = full[0], full[-2:]
    per = 2 if len(full) == 4 else 1
    per_col = 2 if pname.endswith("_packed") else GROUP_SIZE
    r0, nr, c0, nc = 0, rows, 0, cols
    if getattr(p, "shard_dim", None) is not None and par.tp_size > 1:
        if per == 2:
            r0, nr = _chunk(rows, par, f"{pname} rows (moe_intermediate_size)")
        else:
            k = cols * per_col
            start, size = _chunk(k, par, f"{pname} K (moe_intermediate_size)")
            if start % GROUP_SIZE or size % GROUP_SIZE:
                raise CheckpointError(
                    f"{pname}: tensor_parallel_size {par.tp_size} splits K = {k} into "
                    f"{size}-wide slices; MXFP4 slices must be whole groups of {GROUP_SIZE} "
                    f"(K/TP a multiple of {GROUP_SIZE})")
            c0, nc = start // per_col, size // per_col
    want = (n_exp, 2, nr, nc) if per == 2 else (n_exp, nr, nc)
    if tuple(p.shape) != want:
        raise CheckpointError(f"{pname}: rank {par.tp_rank}/{par.tp_size} slice of the experts "
                              f"is {want}, the parameter has {tuple(p.shape)}")
    for e in range(n_exp):
        for j in range(per):
            name = names[per * e + j]
            t = src.read(name, 1, c0, nc) if nc != cols else src.read(name, 0, r0, nr)
            if per_col == GROUP_SIZE:
                _check_scales(name, t)
            (p.data[e, j] if per == 2 else p.data[e]).copy_(t)


@torch.no_grad()
def _load(model: nn.Module, cfg: K3Config, src: _Source, par: Parallel) -> None:
    specs = checkpoint_tensor_specs(cfg)
    _check_headers(src, specs, cfg)
    for pname, p, names, full in _plan(model, specs, cfg):
        m = _EXPERTS.match(pname)
        if m and m["w"] in _RESIDENT:
            _load_resident(pname, p, names, full, src, par)
        elif m:
            _load_experts(pname, p, names, full, src, par)
        elif names[0].endswith(".weight_packed"):
            _load_dense_mxfp4(pname, p, names, full, src, par)
        else:
            _load_dense(pname, p, names[0], full, src, par)


def load_weights(model: nn.Module, ckpt_dir: str | Path, par: Parallel) -> None:
    """Fill every parameter of `model` (built for `par`) from the checkpoint in `ckpt_dir`."""
    d = Path(ckpt_dir)
    cfg = load_config(d)
    _load(model, cfg, _canonical(_file_source(d), cfg), par)


def load_model(ckpt_dir_or_preset: str | Path, par: Parallel = Parallel(),
               comm: Comm = LocalComm(), dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu", seed: int = 0,
               options=None) -> tuple[K3Config, nn.Module]:
    """(cfg, K3ForCausalLM) for a checkpoint folder, or for a preset name with the random
    weights `write_checkpoint(preset, seed=seed)` would write (made in memory, no files).
    options: the replica's kernels.settings.DecodeOptions (None: the served defaults)."""
    from .k3 import K3ForCausalLM

    spec = str(ckpt_dir_or_preset)
    if Path(spec).is_dir():
        cfg = load_config(spec)
        src = _canonical(_file_source(Path(spec)), cfg)
    elif spec in PRESETS:
        cfg = with_test_tokenizer_ids(load_config(spec))
        src = _random_source(cfg, seed)
    else:
        raise CheckpointError(f"model {spec!r}: not a checkpoint folder and not a preset "
                              f"({', '.join(PRESETS)})")
    with torch.device(device):
        model = K3ForCausalLM(cfg, par=par, comm=comm, dtype=dtype, options=options)
    _load(model, cfg, src, par)
    return cfg, model.eval()
