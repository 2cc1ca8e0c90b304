"""kernels.ladder.PARAMETERS, the one table of attention_forward's parameters, against every rung's
declaration of it and against what the launcher (runtime.Instance.launch) passes."""

import re
from types import SimpleNamespace

import numpy as np
import pytest

import kernels
from kernels import ladder, runtime
from tests.test_kernels_cpu import stand_in_instance


def declared(rung) -> list[str]:
    """The kinds of attention_forward's parameters as the rung's file declares them, in order."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", rung.path.read_text(), flags=re.S)
    start = text.index("(", text.index(f"{ladder.ENTRY}("))
    depth, end = 1, start
    while depth:
        end += 1
        depth += {"(": 1, ")": -1}.get(text[end], 0)
    kinds = []
    for param in text[start + 1:end].split(","):
        if "TensorMap" in param or "CUtensorMap" in param:
            kinds.append("tensor map")
        elif "*" in param:
            kinds.append("pointer")
        elif "long long" in param:
            kinds.append("long long")
        else:
            kinds.append(param.split()[0])  # int, float
    return kinds


@pytest.mark.parametrize("name", kernels.names())
def test_every_rung_declares_the_table_s_parameters(name):
    rung = kernels.load(name)
    assert declared(rung) == [kind for _, kind in rung.parameters], rung.parameters


def test_the_table_adds_parameters_by_declaration():
    kinds = {name: {n for n, _ in kernels.load(name).parameters} for name in kernels.names()}
    assert {"lse"} <= kinds["v13_fa2_partitioning"] and "n_heads" not in kinds["v13_fa2_partitioning"]
    assert {"n_heads", "batch", "Q_map"} <= kinds["v24_persistent"]
    assert {"q_scale", "k_scale", "v_scale"} <= kinds["v25_fp8"]
    assert len(kernels.load("v01").parameters) == sum(added_by is None for *_, added_by in ladder.PARAMETERS)


@pytest.mark.parametrize("name", ["v01", "v13", "v24", "v25"])
def test_the_launcher_passes_one_argument_of_the_table_s_kind_per_parameter(monkeypatch, name):
    monkeypatch.setattr(runtime, "device_limits", lambda: runtime.DeviceLimits("stand-in", "sm_90", 132, 1024, 0))
    rung = kernels.load(name)
    inst = stand_in_instance(rung, rung.configs_for(64)[0], per_sm=1)
    monkeypatch.setattr(runtime.driver, "PackedLaunch", lambda fn, grid, block, args, **kw: lambda: fn(grid, block, args))
    stream = SimpleNamespace(ptr=0)  # a lab.tma rung's launch asks for the current stream
    monkeypatch.setattr(runtime, "_cupy", lambda: SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: stream)))
    q, k = np.zeros((2, 4, 100, 64), np.float32), np.zeros((2, 2, 90, 64), np.float32)
    scales = tuple(np.zeros(3, np.float32) for _ in range(3)) if rung.fp8 else ()
    maps = tuple(f"map {t}" for t, _ in rung.tma)
    lse = np.zeros(1, np.float32)
    inst.launch(q, k, k, q, q, 0.125, True, maps, lse=lse, scales=scales)
    (_, args), = inst.function.launches
    expected = {"pointer": np.ndarray, "int": np.int32, "float": np.float32, "long long": np.int64, "tensor map": str}
    assert [type(a) for a in args] == [expected[kind] for _, kind in rung.parameters]
    named = dict(zip([n for n, _ in rung.parameters], args, strict=True))
    assert (int(named["T_q"]), int(named["T_k"]), int(named["kv_group"]), int(named["causal"])) == (100, 90, 2, 1)
    assert int(named["q_head_stride"]) == 100 * 64 and int(named["kv_head_stride"]) == 90 * 64
    assert named["Q"] is q and named["K"] is k and named["O"] is q
    if rung.lse:
        assert named["lse"] is lse
    if rung.persistent:
        assert (int(named["n_heads"]), int(named["batch"])) == (4, 2)
