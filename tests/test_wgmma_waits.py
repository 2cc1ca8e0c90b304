"""tools/wgmma_waits.py on saved listings (nvdisasm of v24 and v29 at d = 128, and of two copies of v24 that
move the wait: the lines it reads) and on small made-up ones; the compile step through NVRTC, which needs no
GPU."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import wgmma_waits  # noqa: E402

SASS = ROOT / "tests" / "fixtures" / "sass"


def listing(*ops: str) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(ops))


@pytest.mark.parametrize("name,products,exponentials", [("v24-d128-waits.sass", 16, 66), ("v29-d128-waits.sass", 18, 114)])
def test_the_saved_rungs_wait_for_every_product_before_their_exponentials(name, products, exponentials):
    step = wgmma_waits.steady_step(wgmma_waits.events((SASS / name).read_text()))
    assert step.products == products and step.wait_one is not None and step.wait_all > step.wait_one
    assert (step.overlapped, step.after) == (0, exponentials)
    assert "does not overlap" in step.verdict()


@pytest.mark.parametrize("name,products,before", [
    ("v24-pinned-d64-waits.sass", 12, 66),        # the row sums stored before wait_group 0 (docs/ladder.md#pinned-softmax)
    ("v24-release-late-d128-waits.sass", 16, 8),  # K_j's release after the softmax: 8 scheduled ahead of it
])
def test_copies_of_v24_that_move_the_wait_are_told_apart(name, products, before):
    step = wgmma_waits.steady_step(wgmma_waits.events((SASS / name).read_text()))
    assert step.products == products and step.wait_all > step.wait_one
    assert (step.overlapped, step.overlapped + step.after) == (before, 66)
    assert step.verdict() == f"{before} of 66 exponentials before the wait for every product"


def test_exponentials_between_the_two_waits_count_as_overlapped():
    ops = ["WARPGROUP.ARRIVE", "HGMMA.64x128x16.F32.BF16 R88, gdesc[UR4], RZ, !UPT", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
           "WARPGROUP.ARRIVE", *["HGMMA.64x128x16.F32.BF16 R88, gdesc[UR4], R88"] * 3, "WARPGROUP.DEPBAR.LE gsb0, 0x1",
           "MUFU.EX2 R1, R1", "@P1 MUFU.EX2 R2, R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R3, R3", "WARPGROUP.ARRIVE"]
    step = wgmma_waits.steady_step(wgmma_waits.events(listing(*ops)))
    assert (step.products, step.arrive, step.wait_one, step.wait_all) == (3, 0x30, 0x70, 0xa0)
    assert (step.overlapped, step.after) == (2, 1)
    assert step.verdict() == "2 of 3 exponentials before the wait for every product"
    assert wgmma_waits.steady_step(wgmma_waits.events(listing("MUFU.EX2 R1, R1"))) is None
    assert "not a wgmma kernel" in wgmma_waits.report("x", listing("MUFU.EX2 R1, R1"))


def test_the_tool_compiles_a_configuration_and_says_where_nvdisasm_is_missing(monkeypatch, capsys):
    name, cubin = wgmma_waits.compiled("v24", "128,128,128,0", "sm_90")
    assert name == "v24_persistent (d_head=128, B_r=128, B_c=128, dtype_id=0)" and cubin[:4] == b"\x7fELF"
    monkeypatch.setattr(wgmma_waits, "nvdisasm", lambda: None)
    with pytest.raises(SystemExit, match="nvdisasm not found"):
        wgmma_waits.disassemble(cubin)
    assert wgmma_waits.main(["--sass", str(SASS / "v24-d128-waits.sass")]) == 0
    assert "0 of 66 exponentials" in capsys.readouterr().out


PINNED = [("v19", "64,64,128,0", 66), ("v19", "64,128,64,0", 34), ("v19", "128,128,64,0", 34),
          ("v21", "64,128,128,0", 66), ("v21", "128,64,64,0", 34),
          ("v22", "64,192,128,0", 66), ("v22", "128,128,128,0", 66), ("v22", "128,128,64,0", 34),
          ("v31", "128,128,128,0", 66), ("v31", "128,128,64,0", 34), ("v34", "128,128,128,0", 66), ("v34", "128,128,64,0", 34)]


@pytest.mark.skipif(wgmma_waits.nvdisasm() is None, reason="no nvdisasm (the test extra installs one)")
@pytest.mark.parametrize("kernel,config,exponentials", PINNED)
def test_the_pinned_rungs_keep_every_exponential_ahead_of_the_wait(kernel, config, exponentials):
    """The store of the row sums before wait_group 0 (docs/ladder.md#pinned-softmax) is what keeps the softmax
    under P V in SASS; an edit that drops it, or moves the sums past the wait, leaves 0 of them ahead."""
    name, cubin = wgmma_waits.compiled(kernel, config, "sm_90")
    step = wgmma_waits.steady_step(wgmma_waits.events(wgmma_waits.disassemble(cubin)))
    assert step is not None, name
    assert (step.overlapped, step.after) == (exponentials, 0), f"{name}: {step.verdict()}"


def test_the_loop_around_the_step_is_counted_by_opcode_on_every_path():
    sass = "\n".join([
        "        /*0000*/                   MOV R1, RZ ;",
        ".L_x_1:",
        "        /*0010*/                   FFMA R2, R2, R3, R4 ;",
        "        /*0020*/                   WARPGROUP.ARRIVE ;",
        "        /*0030*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR4], R88 ;",
        "        /*0040*/                   MUFU.EX2 R5, R5 ;",
        "        /*0050*/              @!P0 BRA `(.L_x_2) ;",  # forward: the rescale's branch, inside the loop
        "        /*0060*/                   FMUL.FTZ R6, R6, R7 ;",
        ".L_x_2:",
        "        /*0070*/                   MUFU.EX2 R8, R8 ;",
        "        /*0080*/               @P1 BRA `(.L_x_1) ;",  # backward, to before the arrive: the loop
        "        /*0090*/                   EXIT ;"])
    step = wgmma_waits.steady_step(wgmma_waits.events(sass))
    loop = wgmma_waits.step_loop(sass, step.arrive)
    assert (loop.start, loop.end) == (0x10, 0x80)
    assert loop.ops == {"BRA": 2, "MUFU": 2, "FFMA": 1, "FMUL": 1, "HGMMA": 1, "WARPGROUP": 1}
    assert loop.summary() == "loop 0x10-0x80: 8 instructions: BRA 2, MUFU 2, FFMA 1, FMUL 1, HGMMA 1, WARPGROUP 1"
    assert wgmma_waits.step_loop(sass.replace("(.L_x_1)", "(.L_x_2)"), step.arrive) is None  # no backward branch


@pytest.mark.skipif(wgmma_waits.nvdisasm() is None, reason="no nvdisasm (the test extra installs one)")
def test_the_mix_of_v34_s_steady_loop(capsys):
    """v34 at d = 64 (docs/ladder.md#v34): a step's 64 scores a thread take 64 exponentials and two for the
    rescale factors, 12 products, and the rescale's 32 FMULs sit on a branch of the same loop."""
    assert wgmma_waits.main(["v34", "--config", "64,192,128,0", "--mix"]) == 0
    out = capsys.readouterr().out
    assert "12 products" in out and "\n  loop 0x" in out
    ops = dict(item.rsplit(" ", 1) for item in out.split("instructions: ")[1].strip().split(", "))
    assert (int(ops["MUFU"]), int(ops["HGMMA"]), int(ops["FMNMX"])) == (66, 12, 68) and int(ops["FMUL"]) >= 32


@pytest.mark.skipif(wgmma_waits.nvdisasm() is None, reason="no nvdisasm (the test extra installs one)")
def test_a_backward_rung_s_phase(capsys):
    """b07's dK/dV phase at d = 64: its largest batch is 16 products, and the loop around it holds both
    of a step's batches (32 HGMMA); a phase it lacks is named with those it has."""
    assert wgmma_waits.main(["b07", "--config", "64,128,128,0,0", "--phase", "backward_dk_dv", "--mix"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("b07_persistent:backward_dk_dv (d_head=64, B_r=128, B_c=128, dtype_id=0, deterministic=0)")
    assert "16 products" in out and "HGMMA 32," in out
    with pytest.raises(SystemExit, match="no phase backward_dx .*backward_preprocess, backward_dk_dv, backward_dq"):
        wgmma_waits.main(["b07", "--config", "64,128,128,0,0", "--phase", "backward_dx"])


@pytest.mark.skipif(wgmma_waits.nvdisasm() is None, reason="no nvdisasm (the test extra installs one)")
def test_a_peeled_first_step_is_not_taken_for_the_steady_one(capsys):
    """b08 at d = 128 compiles a tile's first step apart, before the loop of the others, and its batch of S^T
    and dP^T ties the loop's two batches at 16 products: the last of the tied batches is the steady step, so
    the loop around it is the step's (32 HGMMA: S^T, dP^T, dV_j, dK_j and dQ_i), not the tile's."""
    assert wgmma_waits.main(["b08", "--config", "128,64,128,0,0", "--phase", "backward_dk_dv", "--mix"]) == 0
    out = capsys.readouterr().out
    assert "16 products" in out and "HGMMA 32," in out
