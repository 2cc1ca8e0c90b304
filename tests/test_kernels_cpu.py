"""What can be checked without a GPU: discovery, declarations, compilation with NVRTC for sm_80
and sm_90 (registers and spills), the reference against a direct formula, and input validation."""

import itertools
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kernels
from kernels import ladder, nvrtc, runtime

ARCHES = ["sm_80", "sm_90"]


# -- discovery and names -------------------------------------------------------------------------


def test_rungs_are_discovered_in_ladder_order():
    names = kernels.names()
    assert names[:2] == ["v01_naive", "v02_pad_k"]
    numbers = [int(re.match(r"v(\d+)_", n).group(1)) for n in names]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    for n in names:
        assert re.fullmatch(r"v\d{2}_[a-z0-9_]+", n), f"{n}: rung files are vNN_<change>.cu"


@pytest.mark.parametrize("name", kernels.names())
def test_every_spelling_resolves_to_the_same_rung(name):
    number = int(name[1:3])
    path = kernels.resolve(name)
    assert kernels.resolve(f"v{number}") == path
    assert kernels.resolve(f"v{number:02d}") == path
    assert kernels.resolve(str(path)) == path


def test_unknown_kernel_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown kernel 'v99'.*v01_naive.*v02_pad_k"):
        kernels.resolve("v99")
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels.resolve("v01_wrong_change")
    with pytest.raises(ValueError, match="does not exist"):
        kernels.resolve("/no/such/file.cu")


# -- declarations --------------------------------------------------------------------------------

MINIMAL = """\
/*
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 32, 32), (32, 16, 16)
 * lab.threads    B_c, 16
 * lab.smem       4 * (B_r + 2 * B_c) * d_head
 * lab.workspace  2
 */
template <int d_head, int B_r, int B_c>
__global__ void attention_forward(const float* Q, const float* K, const float* V, float* O,
                                  float* workspace, int T, float scale,
                                  long long a, long long b, long long c, long long d, long long e, long long f)
{
    if (threadIdx.x < d_head) O[threadIdx.x] = Q[threadIdx.x] * scale;
}
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_declarations_are_parsed(tmp_path):
    rung = kernels.load(write(tmp_path, "mine.cu", MINIMAL))
    assert rung.name == "mine"
    assert rung.template == ("d_head", "B_r", "B_c")
    assert rung.configs == ((64, 32, 32), (32, 16, 16))
    assert rung.head_sizes() == [32, 64]
    assert rung.block((64, 32, 32)) == (32, 16, 1)
    assert rung.shared_bytes((64, 32, 32)) == 4 * 96 * 64
    assert rung.workspace_per_row((64, 32, 32)) == 2
    assert rung.name_expression((64, 32, 32)) == "attention_forward<64, 32, 32>"
    assert not rung.strided and rung.options == ()


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda s: s.replace(" * lab.smem       4 * (B_r + 2 * B_c) * d_head\n", ""), "missing declaration.*lab.smem"),
        (lambda s: s.replace("(32, 16, 16)", "(32, 16)"), "does not match lab.template"),
        (lambda s: s.replace("B_c, 16", "B_c, __import__('os')"), "cannot evaluate"),
        (lambda s: s.replace("lab.workspace", "lab.workspaces"), "unknown declaration lab.workspaces"),
        (lambda s: s.replace("d_head, B_r, B_c\n", "B_r, d_head, B_c\n"), "first template parameter must be d_head"),
        (lambda s: s.replace(" * lab.workspace  2\n", " * lab.fp8_v      head\n"), "lab.fp8_v 'head': tile or head, and only with lab.fp8"),
        (lambda s: s.replace(" * lab.workspace  2\n", " * lab.fp8        true\n * lab.fp8_v      row\n"), "lab.fp8_v 'row'"),
        (lambda s: s.replace(" * lab.workspace  2\n", " * lab.fp8_qk     bf16\n"), "lab.fp8_qk 'bf16': e4m3 or bf16, and only with"),
        (lambda s: s.replace(" * lab.workspace  2\n", " * lab.fp8        true\n * lab.fp8_qk     fp16\n"), "lab.fp8_qk 'fp16'"),
    ],
)
def test_bad_declarations_are_clear_errors(tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        kernels.load(write(tmp_path, "bad.cu", edit(MINIMAL)))


CLUSTERED = MINIMAL.replace(" * lab.workspace  2\n", " * lab.split_kv   true\n * lab.cluster    B_c // 4\n * lab.min_arch   sm_90\n").replace(
    "template <int d_head, int B_r, int B_c>\n__global__ void", "template <int d_head, int B_r, int B_c>\n__global__ void __cluster_dims__(B_c / 4, 1, 1)")


def test_cluster_and_min_arch_declarations(tmp_path):
    """lab.cluster: blocks per cluster, from the parameters; with lab.split_kv they are a tile's splits
    whatever the shape, and the partials need no workspace. lab.min_arch: older architectures are
    refused by compile_report (and by the launcher), not compiled into an NVRTC error."""
    rung = kernels.load(write(tmp_path, "clustered.cu", CLUSTERED))
    assert rung.cluster_size((64, 32, 32)) == 8 and rung.cluster_size((32, 16, 16)) == 4
    assert rung.min_arch == 90 and rung.runs_on("sm_90") and rung.runs_on("sm_100a") and not rung.runs_on("sm_80")
    plain = kernels.load(write(tmp_path, "plain.cu", MINIMAL))
    assert plain.cluster is None and plain.cluster_size((64, 32, 32)) is None
    assert plain.min_arch == 0 and plain.runs_on("sm_80")
    inst = object.__new__(runtime.Instance)  # what splits() and workspace_floats() read, without a GPU
    inst.rung, inst.config, inst.B_r, inst.workspace_per_row = rung, (64, 32, 32), 32, 0
    inst.cluster = rung.cluster_size(inst.config)
    assert inst.splits(1, 12, 1, 1) == inst.splits(16, 32, 1, 4096) == 8
    assert inst.workspace_floats(1, 12, 1, 1024) == 0
    assert [r.config["B_c"] for r in kernels.compile_report(str(rung.path), "sm_90")] == [32, 16]
    with pytest.raises(kernels.KernelCompileError, match=r"needs sm_90 or newer \(lab.min_arch\), not sm_80"):
        kernels.compile_report(str(rung.path), "sm_80")
    specific = kernels.load(write(tmp_path, "specific.cu", CLUSTERED.replace(" * lab.min_arch   sm_90\n",
                                                                            " * lab.min_arch   sm_90\n * lab.options    -arch=sm_90a\n")))
    assert specific.runs_on("sm_90") and not specific.runs_on("sm_100") and not specific.runs_on("sm_80")
    with pytest.raises(kernels.KernelCompileError, match=r"needs sm_90 \(lab.options -arch=sm_90a\), not sm_100"):
        kernels.compile_report(str(specific.path), "sm_100")
    for edit, message in [(lambda s: s.replace("sm_90\n", "hopper\n"), "lab.min_arch must look like sm_90"),
                          (lambda s: s.replace("B_c // 4", "B_c"), "a cluster holds 1 to 16 blocks")]:
        with pytest.raises(ValueError, match=message):
            kernels.load(write(tmp_path, "bad.cu", edit(CLUSTERED)))


PERSISTENT = MINIMAL.replace(" * lab.workspace  2\n", " * lab.persistent true\n")


class Recorder:
    """Stands in for a compiled kernel: keeps the grid and arguments of each launch."""

    def __init__(self):
        self.launches = []

    def __call__(self, grid, block, args, shared_mem=0):
        self.launches.append((grid, args))


def stand_in_instance(rung, config, per_sm):
    """An Instance without a GPU: what grid(), workspace_floats() and launch() read."""
    inst = object.__new__(runtime.Instance)
    inst.rung, inst.config, inst.B_r, inst.workspace_per_row = rung, config, rung.params(config)["B_r"], 0
    inst.cluster, inst.block, inst.smem, inst.function = None, rung.block(config), 0, Recorder()
    inst._blocks_per_sm = per_sm
    return inst


def test_a_persistent_rung_gets_the_resident_blocks_and_its_head_and_batch_counts(monkeypatch, tmp_path):
    """lab.persistent: a grid of min(tiles, SMs x blocks per SM) blocks along x, the head and batch
    counts after the strides, and a workspace of the tile counter and the rows' scratch."""
    monkeypatch.setattr(runtime, "device_limits", lambda: runtime.DeviceLimits("stand-in", "sm_90", 132, 1024, 0))
    rung = kernels.load(write(tmp_path, "persistent.cu", PERSISTENT))
    assert rung.persistent and not kernels.load(write(tmp_path, "plain.cu", MINIMAL)).persistent
    inst = stand_in_instance(rung, (64, 32, 32), per_sm=2)
    assert inst.grid(8, 12, 1024, 1024) == (264, 1, 1)  # 32 x 12 x 8 = 3072 tiles, 132 x 2 resident
    assert inst.grid(1, 2, 100, 100) == (8, 1, 1)  # 4 x 2 tiles: one block each
    assert inst.grid(1, 1, 1, 1) == (1, 1, 1)
    assert inst.workspace_floats(8, 12, 1024, 1024) == 1
    inst.workspace_per_row = 2
    assert inst.workspace_floats(8, 12, 1024, 1024) == 1 + 2 * 8 * 12 * 1024
    q = np.zeros((3, 4, 100, 64), np.float32)
    k = np.zeros((3, 2, 90, 64), np.float32)
    inst.launch(q, k, k, q, q, 0.125, True)
    (grid, args), = inst.function.launches
    assert grid == (3 * 4 * 4, 1, 1)
    assert [type(a) for a in args[-8:]] == [np.int64] * 6 + [np.int32] * 2
    assert [int(a) for a in args[-2:]] == [4, 3]  # n_heads, batch
    assert [int(a) for a in args[5:9]] == [100, 90, 2, 1]  # T_q, T_k, kv_group, causal as for any rung
    plain = stand_in_instance(kernels.load(write(tmp_path, "plain.cu", MINIMAL)), (64, 32, 32), per_sm=2)
    assert plain.grid(8, 12, 1024, 1024) == (32, 12, 8)
    plain.launch(q, k, k, q, q, 0.125, True)
    (grid, args), = plain.function.launches
    assert grid == (4, 4, 3) and len(args) == len(inst.function.launches[0][1]) - 2
    with pytest.raises(ValueError, match="at most 2147483647"):
        inst.grid(65535, 65535, 1024, 1024)
    with pytest.raises(ValueError, match="no block fits on an SM"):
        stand_in_instance(rung, (64, 32, 32), per_sm=0).grid(1, 1, 1024, 1024)


@pytest.mark.parametrize("other", [" * lab.split_kv   true\n", " * lab.cluster    2\n"])
def test_persistent_excludes_split_kv_and_clusters(tmp_path, other):
    with pytest.raises(ValueError, match="lab.persistent sizes the grid by the device; it cannot go with lab.(split_kv|cluster)"):
        kernels.load(write(tmp_path, "bad.cu", PERSISTENT.replace(" * lab.persistent true\n", " * lab.persistent true\n" + other)))


TWO_DTYPES = MINIMAL.replace("lab.template   d_head, B_r, B_c\n", "lab.template   d_head, B_r, B_c, dtype_id\n").replace(
    "lab.configs    (64, 32, 32), (32, 16, 16)\n",
    "lab.configs    (64, 32, 32, 0), (64, 32, 32, 1), (64, 16, 16, 1), (32, 16, 16, 0), (32, 16, 16, 1)\n"
    " * lab.dtypes     bfloat16, float16\n * lab.dtype_param dtype_id\n").replace(
    "template <int d_head, int B_r, int B_c>", "template <int d_head, int B_r, int B_c, int dtype_id>")


def test_dtype_param_selects_configs_by_dtype(tmp_path):
    """lab.dtype_param: the parameter's value is the dtype's position in lab.dtypes; the launcher
    looks only at the configs of the inputs' dtype, in declared order."""
    rung = kernels.load(write(tmp_path, "two.cu", TWO_DTYPES))
    assert rung.dtype_param == "dtype_id" and rung.dtypes == ("bfloat16", "float16")
    assert [rung.dtype_of(c) for c in rung.configs] == ["bfloat16", "float16", "float16", "bfloat16", "float16"]
    assert rung.configs_for(64, "float16") == [(64, 32, 32, 1), (64, 16, 16, 1)]
    assert rung.configs_for(64, "bfloat16") == [(64, 32, 32, 0)]
    assert rung.configs_for(64) == [(64, 32, 32, 0), (64, 32, 32, 1), (64, 16, 16, 1)]
    assert rung.configs_for(32, "float32") == []
    assert runtime._as_config(rung, (64, 32, 32, 0)) == (64, 32, 32, 0)  # 0 is a valid dtype index
    assert runtime._as_config(rung, {"d_head": 32, "B_r": 16, "B_c": 16, "dtype_id": 1}) == (32, 16, 16, 1)
    with pytest.raises(ValueError, match="dtype_id must index lab.dtypes"):
        runtime._as_config(rung, (64, 32, 32, 2))
    with pytest.raises(ValueError, match="d_head, B_r and B_c positive"):
        runtime._as_config(rung, (64, 0, 32, 1))
    plain = kernels.load(write(tmp_path, "plain.cu", MINIMAL))
    assert plain.dtype_param is None and plain.dtype_of((64, 32, 32)) is None
    assert plain.configs_for(64, "float32") == [(64, 32, 32)]


def test_dtype_param_instantiations_compile_separately(tmp_path):
    reports = kernels.compile_report(str(write(tmp_path, "two.cu", TWO_DTYPES)), "sm_90")
    assert [r.config["dtype_id"] for r in reports] == [0, 1, 1, 0, 1]


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda s: s.replace("lab.dtype_param dtype_id", "lab.dtype_param d_head"), "not one of the template parameters after d_head"),
        (lambda s: s.replace("lab.dtype_param dtype_id", "lab.dtype_param dtype"), "not one of the template parameters"),
        (lambda s: s.replace("(64, 16, 16, 1)", "(64, 16, 16, 2)"), r"dtype_id=2, but lab.dtypes has 2 entries \(0 = bfloat16, 1 = float16\)"),
        (lambda s: s.replace("(32, 16, 16, 0), ", ""), "no config for d_head=32 in bfloat16"),
    ],
)
def test_bad_dtype_param_is_a_clear_error(tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        kernels.load(write(tmp_path, "bad.cu", edit(TWO_DTYPES)))


def test_rungs_with_a_dtype_param_cover_every_head_size_and_dtype():
    for name in kernels.names():
        rung = kernels.load(name)
        for d in rung.head_sizes():
            for dtype in rung.dtypes:
                assert rung.configs_for(d, dtype), f"{name}: no config for d={d} in {dtype}"


def test_expressions_allow_only_integer_arithmetic():
    assert ladder.evaluate("4 * (B_r + 1) // 2 + max(B_c, 3) % 5 - min(1, 2)", {"B_r": 3, "B_c": 7}) == 9
    for bad in ("B_r ** 2", "open('x')", "B_r.real", "undefined + 1", "1 +"):
        with pytest.raises(ValueError):
            ladder.evaluate(bad, {"B_r": 3})


def test_includes_are_inlined_with_line_directives(tmp_path):
    write(tmp_path, "helper.cuh", "__device__ float twice(float x) { return 2 * x; }\n")
    path = write(tmp_path, "user.cu", MINIMAL.replace("template <int", '#include "helper.cuh"\ntemplate <int'))
    text = ladder.assemble(path)
    assert "twice" in text and '#include "helper.cuh"' not in text
    assert f'#line 1 "{tmp_path / "helper.cuh"}"' in text
    assert re.search(rf'#line \d+ "{re.escape(str(path))}"', text)


def test_an_edited_helper_changes_the_compiled_text(tmp_path):
    """CuPy's disk cache hashes the text it compiles: inlining makes helper edits part of the key."""
    helper = write(tmp_path, "helper.cuh", "__device__ float twice(float x) { return 2 * x; }\n")
    path = write(tmp_path, "user.cu", MINIMAL.replace("template <int", '#include "helper.cuh"\ntemplate <int'))
    before = kernels.load(path).source
    helper.write_text("__device__ float twice(float x) { return x + x + 0; }\n")
    after = kernels.load(path).source
    assert after != before and "x + x + 0" in after


def test_include_cycle_is_an_error(tmp_path):
    write(tmp_path, "a.cuh", '#include "b.cuh"\n')
    write(tmp_path, "b.cuh", '#include "a.cuh"\n')
    with pytest.raises(ValueError, match="cycle"):
        ladder.assemble(write(tmp_path, "c.cu", '#include "a.cuh"\n'))


# -- compilation without a GPU -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", kernels.names())
def test_every_config_compiles_without_spills(name, arch):
    rung = kernels.load(name)
    if not rung.runs_on(arch):
        pytest.skip(f"{name} declares lab.min_arch sm_{rung.min_arch}")
    reports = kernels.compile_report(name, arch)
    assert [tuple(r.config.values()) for r in reports] == list(rung.configs)
    for r in reports:
        assert r.registers > 0, f"{name} {r.config}: no register count in the ptxas report"
        assert r.spill_stores == 0 and r.spill_loads == 0, f"{name} {r.config} on {arch}: spills {r}, {nvrtc.describe()}"
        assert r.stack_bytes <= rung.stack, f"{name} {r.config} on {arch}: {r.stack_bytes} B stack > {rung.stack}"
        assert r.registers * r.threads <= 65536, f"{name} {r.config}: a block needs more registers than an SM has"
        assert not r.performance_warnings, f"{name} {r.config} on {arch}: ptxas says {r.performance_warnings}"
        assert r.threads <= 1024


SERIALIZED_WGMMA = r"""/*
 * lab.template   d_head, B_r, B_c
 * lab.configs    (64, 64, 64)
 * lab.threads    256
 * lab.smem       0
 * lab.min_arch   sm_90
 * lab.options    -arch=sm_90a
 */
#define ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define ACC16(i) ACC4(i), ACC4(i + 4), ACC4(i + 8), ACC4(i + 12)
__device__ __forceinline__ void mma(float (&d)[32], unsigned long long a, unsigned long long b)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
                 "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}"
                 : ACC16(0), ACC16(16) : "l"(a), "l"(b), "r"(1));
}
template <int d_head, int B_r, int B_c>
__global__ void attention_forward(const float* Q, const float* K, const float* V, float* O, float* workspace,
                                  int T_q, int T_k, int kv_group, int causal, float scale,
                                  long long q_batch_stride, long long q_head_stride, long long q_row_stride,
                                  long long kv_batch_stride, long long kv_head_stride, long long kv_row_stride)
{
    float d[32], e[32];
    for (int i = 0; i < 32; ++i) d[i] = e[i] = 0.0f;
    const unsigned long long desc = (unsigned long long)q_row_stride;
    for (int j = 0; j <= T_k; ++j) {
        const bool has_a = j < T_q + (int)(threadIdx.x / 128), has_b = j >= 1;  // warpgroup-dependent
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        if (has_a) { mma(d, desc, desc + j); asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
        if (has_b) { mma(e, desc + 2 * j, desc); asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
        if (has_a && has_b) asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        else asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        if (has_a) for (int i = 0; i < 32; ++i) d[i] = d[i] * scale;
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    }
    for (int i = 0; i < 32; ++i) O[threadIdx.x * 32 + i] = d[i] + e[i];
}
"""


def test_a_serialized_wgmma_pipeline_is_reported(tmp_path):
    """Products issued under warpgroup-dependent branches: ptxas serializes the wgmma pipeline and
    says so (C7520, v19's header); compile_report carries the warning, which the test above forbids."""
    (report,) = kernels.compile_report(str(write(tmp_path, "serialized.cu", SERIALIZED_WGMMA)), "sm_90")
    assert len(report.performance_warnings) == 1
    assert report.performance_warnings[0].startswith("(C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized")


def test_user_kernel_by_path_compiles(tmp_path):
    path = write(tmp_path, "mine.cu", MINIMAL)
    reports = kernels.compile_report(str(path), "sm_90")
    assert len(reports) == 2 and all(r.kernel == "mine" and r.registers > 0 for r in reports)


def test_compile_error_names_the_users_file_and_line(tmp_path):
    broken = MINIMAL.replace("O[threadIdx.x] = Q[threadIdx.x] * scale;", "O[threadIdx.x] = undefined_name;")
    path = write(tmp_path, "broken.cu", broken)
    line = broken.splitlines().index(next(l for l in broken.splitlines() if "undefined_name" in l)) + 1
    with pytest.raises(kernels.KernelCompileError) as info:
        kernels.compile_report(str(path), "sm_90")
    assert f"{path}({line})" in str(info.value)
    assert "undefined_name" in str(info.value)


def test_resources_without_gpu_use_the_named_arch():
    if kernels.gpu_available():
        pytest.skip("this checks the no-GPU path")
    reports = kernels.resources("v02", arch="sm_80")
    assert reports and all(r.arch == "sm_80" and r.blocks_per_sm is None for r in reports)



class StandInInstance:
    """What runtime._fill reads of a compiled configuration: rows per block, threads, occupancy."""

    def __init__(self, config, threads, per_sm):
        self.config, self.B_r, self.block, self.per_sm = config, config[1], (threads, 1, 1), per_sm

    def blocks_per_sm(self):
        return self.per_sm


def test_small_grids_take_the_tile_shape_with_most_warps_resident(monkeypatch, tmp_path):
    """The first declared configuration runs whenever its grid fills the SMs; below that, the
    declared shape (same d_head and non-tile parameters) keeping the most warps resident wins."""
    path = tmp_path / "v01_fill.cu"
    path.write_text(" * lab.template   d_head, B_r, B_c\n"
                    " * lab.configs    (64, 64, 32), (64, 64, 64), (64, 32, 64), (32, 64, 64)\n"
                    " * lab.threads    128\n"
                    " * lab.smem       0\n")
    made = {(64, 64, 32): StandInInstance((64, 64, 32), 128, 4),   # 4 warps, 4 blocks per SM
            (64, 64, 64): StandInInstance((64, 64, 64), 256, 2),   # 8 warps, 2 blocks per SM
            (64, 32, 64): StandInInstance((64, 32, 64), 128, 4)}   # 4 warps, twice the blocks
    compiled = []
    monkeypatch.setattr(runtime, "_compiled", lambda rung, c: compiled.append(c) or made[c])
    monkeypatch.setattr(runtime, "device_limits", lambda: runtime.DeviceLimits("stand-in", "sm_90", 132, 1024, 0))
    runtime._choices.clear()
    chosen = runtime.instance(path, 64, grid=(1, 12, 512))  # 96 blocks of 64 rows: one per SM at most
    assert chosen.config == (64, 64, 64)  # 96 x 8 warps beats 96 x 4, and ties 192 x 4 (declared earlier)
    compiled.clear()
    chosen = runtime.instance(path, 64, grid=(8, 12, 1024))  # 1536 blocks: more than 2 x 132 x 4
    assert chosen.config == (64, 64, 32) and compiled == [(64, 64, 32)]  # nothing else compiled
    assert runtime.instance(path, 64, config=(64, 32, 64), grid=(1, 1, 1)).config == (64, 32, 64)  # asked for
    assert runtime.instance(path, 64).config == (64, 64, 32)  # no shape: the first declared


def test_a_grid_of_a_wave_and_a_part_takes_the_shape_whose_busiest_sm_has_fewest_rows(monkeypatch, tmp_path):
    """Between one and two waves of the first declared shape, the last wave leaves SMs idle: the shape
    with the fewest rows on its busiest SM (waves x B_r) wins, the earlier declared on a tie; from two
    waves on, the first declared runs (GPT-2 XL's prefill: 25 heads x 1,000 rows, one block an SM)."""
    path = tmp_path / "v01_waves.cu"
    path.write_text(" * lab.template   d_head, B_r, B_c\n"
                    " * lab.configs    (64, 192, 128), (64, 128, 128)\n"
                    " * lab.threads    384\n"
                    " * lab.smem       0\n")
    made = {(64, 192, 128): StandInInstance((64, 192, 128), 512, 1),
            (64, 128, 128): StandInInstance((64, 128, 128), 384, 1)}
    monkeypatch.setattr(runtime, "_compiled", lambda rung, c: made[c])
    monkeypatch.setattr(runtime, "device_limits", lambda: runtime.DeviceLimits("stand-in", "sm_90", 132, 1024, 0))
    runtime._choices.clear()
    assert runtime.instance(path, 64, grid=(1, 25, 1000)).config == (64, 128, 128)  # 150 tiles: 2 x 192 vs 2 x 128
    assert runtime.instance(path, 64, grid=(1, 22, 1152)).config == (64, 192, 128)  # 132 tiles: one wave of 192
    assert runtime.instance(path, 64, grid=(1, 40, 1024)).config == (64, 192, 128)  # 240 tiles: 2 x 192 vs 3 x 128
    assert runtime.instance(path, 64, grid=(8, 12, 1024)).config == (64, 192, 128)  # 576 tiles: past two waves


# -- the reference -------------------------------------------------------------------------------


def direct_attention(q, k, v, causal, scale):
    """Softmax attention written as loops in float64: the formula, nothing clever."""
    B, NH, Tq, d = q.shape
    Tk = k.shape[2]
    out = np.zeros((B, NH, Tq, d))
    for b, h, i in itertools.product(range(B), range(NH), range(Tq)):
        keys = [j for j in range(Tk) if not causal or j <= i + (Tk - Tq)]
        if not keys:
            continue
        s = np.array([scale * float(np.dot(q[b, h, i], k[b, h, j])) for j in keys])
        p = np.exp(s - s.max())
        out[b, h, i] = sum(w * v[b, h, j] for w, j in zip(p / p.sum(), keys))
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Tq,Tk", [(1, 1), (17, 17), (5, 12), (12, 5)])
def test_reference_matches_the_formula(causal, Tq, Tk):
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 3, Tq, 8))
    k, v = rng.standard_normal((2, 2, 3, Tk, 8))
    scale = 0.3
    got = kernels.reference_attention(q, k, v, causal=causal, scale=scale)
    assert got.dtype == np.float64 and got.shape == q.shape
    np.testing.assert_allclose(got, direct_attention(q, k, v, causal, scale), rtol=1e-12, atol=1e-12)


def test_reference_default_scale_and_dtypes():
    rng = np.random.default_rng()
    q, k, v = rng.standard_normal((3, 1, 2, 9, 16))
    expected = direct_attention(q, k, v, True, 1 / math.sqrt(16))
    # atol as in the test above: an output near zero (a cancelling sum of p_j v_j) has no relative accuracy
    np.testing.assert_allclose(kernels.reference_attention(q, k, v), expected, rtol=1e-12, atol=1e-12)
    out32 = kernels.reference_attention(*(x.astype(np.float32) for x in (q, k, v)))
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reference_low_precision_recipe(dtype):
    """float16/bfloat16 in: float32 products, P rounded to the dtype, output in the dtype."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((2, 2, 33, 16)).astype(dtype) for _ in range(3))
    out = kernels.reference_attention(q, k, v)
    assert out.dtype == np.dtype(dtype)
    exact = direct_attention(*(x.astype(np.float64) for x in (q, k, v)), True, 0.25)
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    err = np.abs(out.astype(np.float64) - exact).max()
    assert err < 4 * eps * np.abs(exact).max()
    assert err > 0  # it really rounded


def test_reference_causal_rows_ignore_future_keys():
    rng = np.random.default_rng()
    q, k, v = rng.standard_normal((3, 1, 1, 6, 4))
    k2, v2 = k.copy(), v.copy()
    k2[..., 3:, :] = 1e3 * rng.standard_normal(k2[..., 3:, :].shape)
    v2[..., 3:, :] = rng.standard_normal(v2[..., 3:, :].shape)
    a = kernels.reference_attention(q, k, v)
    b = kernels.reference_attention(q, k2, v2)
    np.testing.assert_array_equal(a[..., :3, :], b[..., :3, :])


def test_reference_propagates_nan():
    rng = np.random.default_rng()
    q, k, v = rng.standard_normal((3, 1, 1, 5, 4))
    v[0, 0, 2, 1] = np.nan
    out = kernels.reference_attention(q, k, v)
    assert not np.isnan(out[0, 0, :2]).any()  # rows that cannot see key 2
    assert np.isnan(out[0, 0, 2:, 1]).all()


def test_reference_rejects_bad_input():
    x = np.ones((1, 1, 4, 8))
    with pytest.raises(ValueError, match="4-d"):
        kernels.reference_attention(x[0], x, x)
    with pytest.raises(ValueError, match="shapes disagree"):
        kernels.reference_attention(x, x, np.ones((1, 1, 5, 8)))


# -- input validation (the checks that need no GPU) ----------------------------------------------


def qkv(shape=(2, 3, 5, 64), dtype=np.float32):
    rng = np.random.default_rng()
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


def check(q, k, v, kernel="v01", causal=True, scale=None):
    runtime.check_layout(q, k, v, kernels.load(kernel), causal, scale)


def test_valid_layouts_pass():
    check(*qkv())
    packed = np.zeros((2, 5, 3, 3, 64), np.float32)
    check(*(packed[:, :, i].transpose(0, 2, 1, 3) for i in range(3)))


@pytest.mark.parametrize(
    "make,error,message",
    [
        (lambda: qkv(dtype=np.float64), TypeError, "dtype float64.*supports float32"),
        (lambda: qkv(dtype=np.float16), TypeError, "dtype float16"),
        (lambda: tuple(x[0] for x in qkv()), ValueError, "4 dimensions"),
        (lambda: qkv()[:2] + (qkv((2, 3, 6, 64))[0],), ValueError, "shapes disagree"),
        (lambda: (qkv()[0],) + qkv((2, 2, 5, 64))[:2], ValueError, "multiple of the key/value heads"),
        (lambda: (qkv()[0],) + qkv((2, 1, 5, 64))[:2], ValueError, "does not support 1 key/value heads for 3 query heads; .*v15_bf16_mma"),
        (lambda: (qkv()[0],) + qkv((2, 3, 7, 64))[:2], ValueError, "does not support query length 5 != key length 7"),
        (lambda: qkv((2, 3, 5, 80)), ValueError, r"head sizes 32, 64, 128; got d=80"),
        (lambda: qkv((2, 3, 0, 64)), ValueError, "empty input"),
        (lambda: tuple(x[..., ::2] for x in qkv((2, 3, 5, 128))), ValueError, "unit stride"),
        (lambda: qkv((1, 65536, 1, 64)), ValueError, "at most 65535"),
    ],
)
def test_bad_layouts_are_clear_errors(make, error, message):
    with pytest.raises(error, match=message):
        check(*make())


def test_non_causal_and_bad_scale_are_rejected():
    with pytest.raises(ValueError, match="does not support causal=False"):
        check(*qkv(), causal=False)
    with pytest.raises(ValueError, match="finite"):
        check(*qkv(), scale=float("nan"))


def test_numpy_arrays_are_refused_by_gpu_rungs():
    with pytest.raises(TypeError, match="NumPy array.*CuPy"):
        kernels.attention(*qkv(), kernel="v02")


def test_unknown_kernel_in_attention():
    with pytest.raises(ValueError, match="known kernels are v01_naive"):
        kernels.attention(*qkv(), kernel="v00")


def test_reference_grouped_query_heads_share_key_value_heads():
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 6, 7, 8))
    k, v = rng.standard_normal((2, 2, 2, 7, 8))
    got = kernels.reference_attention(q, k, v)
    # query heads 0-2 read K/V head 0, heads 3-5 read K/V head 1
    expected = kernels.reference_attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match="multiple"):
        kernels.reference_attention(q, k[:, :1].repeat(4, axis=1), v[:, :1].repeat(4, axis=1))


# -- the log-sum-exp (lab.lse) -------------------------------------------------------------------


def direct_lse(q, k, causal, scale):
    """Each row's log-sum-exp of its scaled scores, as loops in float64; +inf for a row that sees no key."""
    B, NH, Tq, _ = q.shape
    Tk = k.shape[2]
    out = np.full((B, NH, Tq), np.inf)
    for b, h, i in itertools.product(range(B), range(NH), range(Tq)):
        s = [scale * float(np.dot(q[b, h, i], k[b, h, j])) for j in range(Tk) if not causal or j <= i + (Tk - Tq)]
        if s:
            out[b, h, i] = max(s) + math.log(sum(math.exp(x - max(s)) for x in s))
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Tq,Tk", [(1, 1), (17, 17), (5, 12), (12, 5)])
def test_reference_lse_matches_the_formula(causal, Tq, Tk):
    rng = np.random.default_rng(Tq * 100 + Tk * 10 + causal)  # seeded: CI runs it the same every time
    q = rng.standard_normal((2, 3, Tq, 8))
    k, v = rng.standard_normal((2, 2, 3, Tk, 8))
    out, lse = kernels.reference_attention(q, k, v, causal=causal, scale=0.3, return_lse=True)
    np.testing.assert_array_equal(out, kernels.reference_attention(q, k, v, causal=causal, scale=0.3))
    assert lse.shape == (2, 3, Tq) and lse.dtype == np.float64
    # relative to the row's scores, not to the log-sum-exp itself, which can sit near zero (a draw once
    # gave 3.0e-4, off by 4e-17: 1.4e-13 of it), so an absolute floor of float64's rounding of them too
    np.testing.assert_allclose(lse, direct_lse(q, k, causal, 0.3), rtol=1e-13, atol=1e-14)
    if causal and Tq > Tk:  # the first Tq - Tk rows see no key
        assert np.isposinf(lse[..., : Tq - Tk]).all() and np.isfinite(lse[..., Tq - Tk:]).all()


def test_reference_lse_of_low_precision_inputs_is_float32():
    import ml_dtypes

    q, k, v = (np.random.default_rng().standard_normal((1, 2, 9, 16)).astype(ml_dtypes.bfloat16) for _ in range(3))
    out, lse = kernels.reference_attention(q, k, v, return_lse=True)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    exact = direct_lse(*(x.astype(np.float64) for x in (q, k)), True, 0.25)
    # float32's rounding, relative to max(1, |lse|): a row's lse can sit near 0, where rtol alone asks for
    # more than float32 holds (a bfloat16-rounded lse would be 1e-2 off)
    np.testing.assert_allclose(lse, exact, rtol=1e-6, atol=1e-6)


LSE_RUNGS = [n for n in kernels.names() if kernels.load(n).lse]


def test_the_lse_writers_include_the_fa2_and_tensor_core_rungs():
    assert {"v13_fa2_partitioning", "v14_tf32_mma", "v15_bf16_mma"} <= set(LSE_RUNGS)


@pytest.mark.parametrize("name", LSE_RUNGS)
def test_lse_rungs_take_the_lse_parameter_last(name):
    """lab.lse promises a `float* lse` after the strides: a rung declaring it without the parameter
    would read a missing argument as a pointer and write through it."""
    source = kernels.resolve(name).read_text()
    signature = re.search(r"attention_forward\((.*?)\)\s*\{", source, re.S).group(1)
    assert re.search(r"float\s*\*\s*__restrict__\s+lse\s*$", signature.strip()), signature[-120:]


def test_return_lse_needs_a_rung_that_writes_it():
    with pytest.raises(ValueError, match=r"kernel v12_o_in_registers does not write the log-sum-exp \(lab.lse\); "
                                         r"v13_fa2_partitioning, v14_tf32_mma"):
        kernels.attention(*qkv(), kernel="v12", return_lse=True)
    with pytest.raises(ValueError, match="Triton rung t01 does not write the log-sum-exp"):
        kernels.attention(*qkv(), kernel="t01", return_lse=True)


def test_lse_declaration(tmp_path):
    assert not kernels.load(write(tmp_path, "plain.cu", MINIMAL)).lse
    assert kernels.load(write(tmp_path, "lse.cu", MINIMAL.replace(" * lab.workspace  2\n", " * lab.lse        true\n"))).lse


# -- Attend.prepare of inputs in another dtype (a bfloat16 run's float32 prefill) ------------------


class StandIn:
    """kernels.prepare and CuPy's empty and copyto over NumPy: the rung is the reference attention on
    what its arrays hold at launch; it counts the prepares and records each copyto's destination."""

    def __init__(self, monkeypatch):
        self.prepares, self.copied = [], []
        monkeypatch.setattr(runtime, "prepare", self.prepare)
        monkeypatch.setattr(runtime, "_cupy", lambda: SimpleNamespace(empty=np.empty, copyto=self.copyto))

    def prepare(self, q, k, v, *, kernel, causal=True, **options):
        self.prepares.append((q, k, v))
        return kernels.Prepared(lambda: kernels.reference_attention(q, k, v, causal=causal), None, reads_inputs=True)

    def copyto(self, dst, src, casting):
        self.copied.append(dst)
        np.copyto(dst, src, casting=casting)


def prefill_views(T=9, NH=4, hs=64):
    """q, k, v (1, NH, T, hs) float32 views of one packed (T, 3 * NH * hs) buffer, as gpt2.fast's pass
    hands them, and the buffer (new contents each layer)."""
    qkv = np.zeros((T, 3 * NH * hs), np.float32)
    views = qkv.reshape(1, T, 3, NH, hs)  # (B, T, 3, NH, hs)
    return qkv, *(views[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


def test_a_prepared_cast_prepares_once_and_casts_into_the_same_copies(monkeypatch):
    """PREPARE_CASTS on: float32 inputs into a bfloat16 rung prepare it once, on contiguous bfloat16
    copies; every run casts the inputs' new contents into those copies and the output back into one
    float32 array, the values of a call (Attend.__call__) bit for bit."""
    stand_in = StandIn(monkeypatch)
    monkeypatch.setattr(runtime, "PREPARE_CASTS", True)
    attend = kernels.Attend("v15", dtype="bfloat16")
    qkv, q, k, v = prefill_views()
    run = attend.prepare(q, k, v)
    (copies,) = stand_in.prepares
    assert all(c.dtype.name == "bfloat16" and c.flags.c_contiguous and c.shape == q.shape for c in copies)
    rng, outs = np.random.default_rng(0), []
    for _ in range(3):
        qkv[...] = rng.standard_normal(qkv.shape)  # the layer's projection
        stand_in.copied.clear()
        prepared = len(stand_in.prepares)
        got = run()
        assert len(stand_in.prepares) == prepared and len(stand_in.copied) == 4
        assert all(a is b for a, b in zip(stand_in.copied[:3], copies, strict=True)) and stand_in.copied[3] is got
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, attend(q, k, v))
        outs.append(got)
    assert outs[0] is outs[1] is outs[2]


def test_a_prepared_cast_of_cross_lengths_and_shared_heads(monkeypatch):
    """The copies take each input's own shape: 97 queries over 257 keys, 2 key/value heads for 8."""
    stand_in = StandIn(monkeypatch)
    monkeypatch.setattr(runtime, "PREPARE_CASTS", True)
    attend = kernels.Attend("v24", dtype="bfloat16")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 8, 97, 64)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 2, 257, 64)).astype(np.float32)
    run = attend.prepare(q, k, v)
    assert [c.shape for c in stand_in.prepares[0]] == [q.shape, k.shape, v.shape]
    for _ in range(2):
        np.testing.assert_array_equal(run(), attend(q, k, v))
        q[...] = rng.standard_normal(q.shape)


def test_without_prepare_casts_every_run_is_a_call(monkeypatch):
    """PREPARE_CASTS off (and for an FP8 rung, which quantizes its inputs when prepared, either way):
    nothing is prepared ahead, and each run casts, prepares and launches anew."""
    for on, kernel in ((False, "v15"), (True, "v25")):
        stand_in = StandIn(monkeypatch)
        monkeypatch.setattr(runtime, "PREPARE_CASTS", on)
        attend = kernels.Attend(kernel, dtype="bfloat16")
        qkv, q, k, v = prefill_views()
        run = attend.prepare(q, k, v)
        assert stand_in.prepares == []
        for seed in (1, 2):
            qkv[...] = np.random.default_rng(seed).standard_normal(qkv.shape)
            prepared = len(stand_in.prepares)
            got = run()
            assert len(stand_in.prepares) == prepared + 1 and stand_in.copied == [] and got.dtype == np.float32
            np.testing.assert_array_equal(got, attend(q, k, v))


def test_zeroed_on_waits_only_across_streams_and_on_the_host_while_capturing():
    """runtime.ZeroedOn (WAIT_BY_EVENT): a launch on the stream that queued the zeros waits for nothing; one on
    another stream waits for their event on the device, or, while that stream captures a graph, on the host."""
    said = []

    class Event:
        def synchronize(self):
            said.append("host waits")

    class Stream:
        def __init__(self, ptr, capturing=False):
            self.ptr, self.capturing = ptr, capturing

        def record(self):
            said.append(f"recorded on {self.ptr}")
            return Event()

        def is_capturing(self):
            return self.capturing

        def wait_event(self, event):
            said.append(f"stream {self.ptr} waits")

    current = [Stream(0)]
    cupy = SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: current[0]))
    zeroed = runtime.ZeroedOn(cupy)
    zeroed.wait()  # the same stream (the legacy one, ptr 0): its order suffices
    current[0] = Stream(7)
    zeroed.wait()
    current[0] = Stream(9, capturing=True)
    zeroed.wait()
    assert said == ["recorded on 0", "stream 7 waits", "host waits"]
    assert runtime.WAIT_BY_EVENT is False  # opt-in until the GPU tests have run with it
