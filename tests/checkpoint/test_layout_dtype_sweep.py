"""Acceptance sweep: tensor kinds and layouts through save -> load/reshard/convert, bit for bit.

Every case runs in one process: several ``Checkpointer`` objects stand for the ranks of a
job (writer threads), as in ``test_universal.py``. Uneven shards (a dimension not divisible
by the rank count, DTensor's ``torch.chunk`` split, empty last shards included) come from a
sharding hook that builds the same global map ``dtensor_map`` builds for a DTensor, so no
process group is needed. Values are compared as bytes: NaN payloads, -0.0 and float8 bit
patterns must survive, and ``torch.equal`` would call NaN different from itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from checkpoint import (
    CheckpointConfig,
    CheckpointConfigError,
    Checkpointer,
    CheckpointLayoutError,
    CheckpointStore,
    load,
    reshard,
)
from checkpoint._convert import to_safetensors, to_universal
from checkpoint._reshard import consolidate
from checkpoint.geometry import LocalBox, boxes_to_pieces
from checkpoint.manifest import GlobalMap, rank_manifest_name, step_dir_name
from checkpoint.rules import ParallelLayout
from checkpoint.sharding import ShardingSpec

Hook = Callable[[str, torch.Tensor], tuple[torch.Tensor, GlobalMap | None]]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (values of a lazy conj/neg view resolved first)."""
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(_bytes(got), _bytes(want))
    )


def _save(
    root: Path, states: list[dict[str, object]], *, hooks: list[Hook] | None = None, step: int = 1
) -> None:
    """Rank r of a len(states)-rank job saves states[r]; rank 0 commits last."""
    engines = []
    for rank, state in enumerate(states):
        engine = Checkpointer(
            CheckpointConfig(root=root, writer="thread", include_rng=False),
            rank=rank,
            world_size=len(states),
            sharding=hooks[rank] if hooks else None,
        )
        assert engine.save(state, step=step)
        engines.append(engine)
    for engine in reversed(engines):
        engine.close()
    assert CheckpointStore(root).resolve()[0][0] == step


def _random_bits(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Every bit pattern is fair game (NaNs, infinities, subnormals, -0.0), except for bool,
    whose only valid bytes are 0 and 1."""
    gen = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
]
NO_SAFETENSORS = {torch.complex64}  # safetensors (as written here) has no complex dtype


def _key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(scope="module")
def dtype_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("dtypes")
    state = {_key(d): _random_bits(d, (5, 3)) for d in DTYPES}
    _save(root, [dict(state)])
    return root, state


@pytest.mark.parametrize("dtype", DTYPES, ids=_key)
def test_dtype_saves_and_loads_exactly(
    dtype_ckpt: tuple[Path, dict[str, torch.Tensor]], dtype: torch.dtype
) -> None:
    root, state = dtype_ckpt
    got = load(root, {}, restore_rng=False).values[_key(dtype)]
    assert _same(got, state[_key(dtype)])


@pytest.mark.parametrize("dtype", DTYPES, ids=_key)
def test_dtype_survives_universal_then_reshard(
    dtype_ckpt: tuple[Path, dict[str, torch.Tensor]], dtype: torch.dtype, tmp_path: Path
) -> None:
    root, state = dtype_ckpt
    to_universal(root, tmp_path / "u")
    target = {_key(dtype): torch.empty_like(state[_key(dtype)])}
    reshard(tmp_path / "u", target)
    assert _same(target[_key(dtype)], state[_key(dtype)])


@pytest.mark.parametrize("dtype", DTYPES, ids=_key)
def test_dtype_to_safetensors_is_exact_or_refused(dtype: torch.dtype, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    want = _random_bits(dtype, (4, 6))
    _save(tmp_path / "src", [{"t": want}])
    out = tmp_path / "out.safetensors"
    if dtype in NO_SAFETENSORS:
        with pytest.raises(CheckpointConfigError, match=rf"'t': safetensors has no {_key(dtype)}"):
            to_safetensors(tmp_path / "src", out)
        assert not out.exists()  # no half-written file left behind
        return
    to_safetensors(tmp_path / "src", out)
    assert _same(load_file(str(out))["t"], want)


UNSUPPORTED = [
    getattr(torch, n)
    for n in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex32")
    if hasattr(torch, n)
]


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=_key)
def test_dtype_no_reader_accepts_is_refused_at_save(dtype: torch.dtype, tmp_path: Path) -> None:
    """Before the fix the save went ahead and failed later, at the commit, as a *corrupt*
    manifest ("unknown dtype"): every periodic save of such a state failed in the
    background. Now ``save`` says so at once, naming the tensor, and the engine goes on."""
    engine = Checkpointer(CheckpointConfig(root=tmp_path, writer="thread"), rank=0, world_size=1)
    try:
        bad = torch.zeros(4, dtype=torch.uint8).view(dtype)
        with pytest.raises(CheckpointConfigError, match=rf"'model/q' has dtype {_key(dtype)}"):
            engine.save({"model": {"q": bad}}, step=1)
        assert engine.save({"model": {"q": torch.ones(2)}}, step=2)
    finally:
        engine.close()
    assert [i.step for i in CheckpointStore(tmp_path).list() if i.complete] == [2]


SHAPES: dict[str, torch.Tensor] = {
    "scalar_f64": torch.tensor(3.5, dtype=torch.float64),
    "scalar_i64": torch.tensor(7),
    "zero_size": torch.empty(0, 4),
    "zero_size_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
    "thin": torch.tensor([[1.25]]),
    "odd": torch.randn(1001, 7, generator=torch.Generator().manual_seed(1)),
}


def test_shapes_round_trip_through_load_universal_and_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    _save(tmp_path / "src", [dict(SHAPES)])
    got = load(tmp_path / "src", {}, restore_rng=False).values
    to_universal(tmp_path / "src", tmp_path / "u")
    targets = {k: torch.full_like(v, 9) for k, v in SHAPES.items()}
    reshard(tmp_path / "u", targets)
    to_safetensors(tmp_path / "src", tmp_path / "s.safetensors")
    st = load_file(str(tmp_path / "s.safetensors"))
    for name, want in SHAPES.items():
        assert _same(got[name], want), name
        assert _same(targets[name], want), name
        assert _same(st[name], want), name


def test_views_load_as_independent_correct_values(tmp_path: Path) -> None:
    """Non-contiguous tensors and views are saved as their values (materialised: each entry
    is numel x element size bytes, however large the storage behind it), and load as
    contiguous tensors of their own; two views of one storage come back as two tensors."""
    base = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    storage = torch.arange(12, dtype=torch.float64)
    views = {
        "transposed": base.t(),
        "slice": base[1:4, 2:7],
        "stepped": base[::2, ::3],
        "view_a": storage[:6],
        "view_b": storage[3:].view(3, 3),  # overlaps view_a
        "expanded": torch.tensor([1.0, 2.0, 3.0]).expand(4, 3),  # stride 0
        "expanded_0d": torch.tensor(5, dtype=torch.int8).expand(2, 3),
        "conj": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),  # lazy conj bit
        "neg": torch._neg_view(torch.tensor([1.0, -2.0])),  # lazy neg bit
    }
    _save(tmp_path, [dict(views)])
    got = load(tmp_path, {}, restore_rng=False).values
    for name, want in views.items():
        assert _same(got[name], want), name
        assert got[name].is_contiguous() and not got[name].is_conj() and not got[name].is_neg()
    assert got["view_a"].untyped_storage().data_ptr() != got["view_b"].untyped_storage().data_ptr()
    got["view_a"][3] = -1  # the overlap is not shared after load
    assert got["view_b"][0, 0].item() == 3.0
    manifest = json.loads(
        (tmp_path / step_dir_name(1) / rank_manifest_name(0)).read_text(encoding="utf-8")
    )
    nbytes = {e["name"]: e["nbytes"] for e in manifest["entries"]}
    assert nbytes["expanded"] == 4 * 3 * 4 and nbytes["view_a"] == 6 * 8
    # Resharded loads fill targets in place through flat views, so a view target is refused.
    with pytest.raises(CheckpointLayoutError, match=r"'transposed': target must be contiguous"):
        reshard(tmp_path, {"transposed": torch.empty(5, 8).t()})


def _chunk(full: torch.Tensor, world: int, rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s shard as ``torch.chunk``/DTensor ``Shard(dim)`` cut it: ceil-sized
    shards, a short last one, empty ones past the end."""
    n = full.shape[dim]
    per = -(-n // world)
    start = min(rank * per, n)
    return full.narrow(dim, start, max(0, min(per, n - start))).clone()


def _chunk_hook(world: int, rank: int, dim: int, shapes: Mapping[str, list[int]]) -> Hook:
    """The global map ``dtensor_map`` gives a ``Shard(dim)`` DTensor on ``world`` ranks."""

    def hook(name: str, value: torch.Tensor) -> tuple[torch.Tensor, GlobalMap | None]:
        glob = shapes[name]
        per = -(-glob[dim] // world)
        offsets = [0] * len(glob)
        offsets[dim] = min(rank * per, glob[dim])
        box = LocalBox(
            global_offsets=tuple(offsets),
            local_offsets=(0,) * len(glob),
            shape=tuple(value.shape),
        )
        pieces = boxes_to_pieces([box], list(value.shape))
        return value, GlobalMap(name=name, shape=list(glob), placement="shard", pieces=pieces)

    return hook


UNEVEN = {
    "w": torch.randn(10, 7, generator=torch.Generator().manual_seed(2)),
    "bf16": _random_bits(torch.bfloat16, (11, 13)),
    "cplx": _random_bits(torch.complex64, (5, 6)),
    "tiny": torch.arange(2 * 3, dtype=torch.int8).reshape(2, 3),  # empty shards on 3+ ranks
}


@pytest.mark.parametrize("dim", [0, 1], ids=["rows", "cols"])
@pytest.mark.parametrize(("src", "dst"), [(3, 4), (4, 3), (2, 5), (3, 1)])
def test_uneven_shards_reshard_to_any_rank_count(
    tmp_path: Path, dim: int, src: int, dst: int
) -> None:
    shapes = {k: list(v.shape) for k, v in UNEVEN.items()}
    _save(
        tmp_path,
        [{k: _chunk(v, src, r, dim) for k, v in UNEVEN.items()} for r in range(src)],
        hooks=[_chunk_hook(src, r, dim, shapes) for r in range(src)],
    )
    for rank in range(dst):
        want = {k: _chunk(v, dst, rank, dim) for k, v in UNEVEN.items()}
        targets = {k: torch.zeros_like(v) for k, v in want.items()}
        reshard(tmp_path, targets, sharding=_chunk_hook(dst, rank, dim, shapes))
        for name in want:
            assert _same(targets[name], want[name]), (rank, name)
    # Split along the other dimension on load (rows saved, columns loaded, and vice versa).
    other = 1 - dim
    for rank in range(dst):
        targets = {"w": torch.zeros_like(_chunk(UNEVEN["w"], dst, rank, other))}
        reshard(tmp_path, targets, sharding=_chunk_hook(dst, rank, other, shapes))
        assert _same(targets["w"], _chunk(UNEVEN["w"], dst, rank, other)), rank
    with CheckpointStore(tmp_path).open_latest() as reader:
        whole = dict(consolidate(reader))
    for name, full in UNEVEN.items():
        assert _same(whole[name], full), name


def _adam_rank(weight: torch.Tensor, steps: int) -> tuple[torch.nn.Module, torch.optim.Adam]:
    model = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        model.weight.copy_(weight)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for i in range(steps):
        opt.zero_grad()
        (model.weight * (i + 1)).square().sum().backward()
        opt.step()
    return model, opt


def _tp_spec(tp: int, rank: int) -> ShardingSpec:
    return ShardingSpec(
        [
            {"pattern": "model/weight", "rule": "shard", "dim": 0},
            {"pattern": "optim/state/*/exp_avg*", "rule": "shard", "dim": 0},
            {"pattern": "optim/state/*/step", "rule": "replicate"},
        ],
        layout=ParallelLayout(tp=tp, tp_rank=rank),
    )


def test_adam_state_and_its_0d_step_survive_a_gather_reshard(tmp_path: Path) -> None:
    """TP=2 (rows) -> one rank: weight and both moments are the rows of the two ranks, the
    step counter (Adam's 0-d float tensor) is the saved one, not the target's own."""
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    ranks = [_adam_rank(full[r * 3 : (r + 1) * 3], steps=3) for r in range(2)]
    _save(
        tmp_path,
        [{"model": m, "optim": o} for m, o in ranks],
        hooks=[_tp_spec(2, r) for r in range(2)],
    )
    model, opt = _adam_rank(torch.zeros(6, 5), steps=1)  # the optimizer state must exist
    reshard(tmp_path, {"model": model, "optim": opt}, sharding=_tp_spec(1, 0))
    saved = [o.state[m.weight] for m, o in ranks]
    got = opt.state[model.weight]
    assert _same(model.weight.detach(), torch.cat([m.weight.detach() for m, _ in ranks]))
    for moment in ("exp_avg", "exp_avg_sq"):
        assert _same(got[moment], torch.cat([s[moment] for s in saved])), moment
    assert got["step"].dim() == 0 and got["step"].item() == 3.0
    assert isinstance(model.weight, torch.nn.Parameter) and model.weight.requires_grad


def test_an_int_step_counter_is_restored_by_load_and_left_alone_by_reshard(
    tmp_path: Path,
) -> None:
    """A plain-int step is part of the pickled skeleton: ``load`` restores it exactly;
    ``reshard`` moves tensors only, so the target keeps its own (documented)."""
    state = {"p": torch.ones(2, 2), "opt_state": {"step": 2, "exp_avg": torch.ones(2)}}
    _save(tmp_path, [state])
    got = load(tmp_path, {}, restore_rng=False).values["opt_state"]
    assert got["step"] == 2 and type(got["step"]) is int
    target = {"p": torch.zeros(2, 2), "opt_state": {"step": 0}}
    reshard(tmp_path, target)
    assert target["opt_state"]["step"] == 0


def test_one_tensor_referenced_twice_loads_as_two_tensors(tmp_path: Path) -> None:
    """Aliasing is not kept: each reference is its own entry (its bytes written twice) and
    loads as an independent tensor with the right value (documented)."""
    shared = torch.randn(3, generator=torch.Generator().manual_seed(4))
    _save(tmp_path, [{"a": shared, "nest": {"b": shared, "list": [shared, shared]}}])
    got = load(tmp_path, {}, restore_rng=False).values
    a, b, (c, d) = got["a"], got["nest"]["b"], got["nest"]["list"]
    for t in (a, b, c, d):
        assert _same(t, shared)
    assert len({t.untyped_storage().data_ptr() for t in (a, b, c, d)}) == 4
    a.add_(1)
    assert _same(b, shared)


def test_tied_module_weights_stay_tied_after_load(tmp_path: Path) -> None:
    """Modules are restored in place (``load_state_dict``), so a weight two submodules share
    is still one Parameter after load, holding the saved value."""

    def tied() -> torch.nn.Module:
        m = torch.nn.Module()
        m.emb = torch.nn.Embedding(4, 3)
        m.head = torch.nn.Linear(3, 4, bias=False)
        m.head.weight = m.emb.weight
        return m

    src = tied()
    _save(tmp_path, [{"model": src}])
    dst = tied()
    load(tmp_path, {"model": dst}, restore_rng=False)
    assert dst.head.weight is dst.emb.weight
    assert _same(dst.emb.weight.detach(), src.emb.weight.detach())


def test_parameter_status_kept_by_modules_not_by_loose_tensors(tmp_path: Path) -> None:
    """A module's parameters are filled in place: Parameter and ``requires_grad`` (a frozen
    one stays frozen) are the target's. A loose Parameter or ``requires_grad`` tensor among
    the plain values comes back as a plain tensor without grad (documented)."""
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    loose = torch.nn.Parameter(torch.ones(2))
    _save(tmp_path, [{"model": model, "loose": loose, "rg": torch.ones(3, requires_grad=True)}])
    target = torch.nn.Linear(2, 2)
    target.bias.requires_grad_(False)
    got = load(tmp_path, {"model": target}, restore_rng=False).values
    assert isinstance(target.weight, torch.nn.Parameter) and target.weight.requires_grad
    assert not target.bias.requires_grad
    assert _same(target.weight.detach(), model.weight.detach())
    assert type(got["loose"]) is torch.Tensor and not got["loose"].requires_grad
    assert _same(got["loose"], loose.detach()) and not got["rg"].requires_grad


def test_replicated_tensor_holding_nan_converts(tmp_path: Path) -> None:
    """Two DP replicas holding the same NaN (a diverged run one wants to inspect) are the
    same bytes. Before the fix, ``consolidate``'s replica check compared values, called
    NaN != NaN, and refused the conversion ("replicated copies differ")."""
    value = torch.tensor([1.0, float("nan"), -0.0, float("inf")])
    hooks = [
        ShardingSpec(
            [{"pattern": "*", "rule": "replicate"}], layout=ParallelLayout(dp=2, dp_rank=r)
        )
        for r in range(2)
    ]
    engines = []
    for rank in range(2):  # dedup off: each replica is written, so the check has two copies
        engine = Checkpointer(
            CheckpointConfig(root=tmp_path / "src", writer="thread", dedup_replicas=False),
            rank=rank,
            world_size=2,
            sharding=hooks[rank],
        )
        engine.save({"x": value.clone()}, step=1)
        engines.append(engine)
    for engine in reversed(engines):
        engine.close()
    with CheckpointStore(tmp_path / "src").open_latest() as reader:
        assert _same(dict(consolidate(reader))["x"], value)
    to_universal(tmp_path / "src", tmp_path / "u")
    target = {"x": torch.zeros(4)}
    reshard(tmp_path / "u", target)
    assert _same(target["x"], value)
