"""Where ptxas put a consumer's waits for its products, against its softmax's exponentials.

A rung that overlaps the softmax with the tensor cores (v19 and after) issues S_ij = Q_i K_j^T and
P_i,j-1 V_j-1 together, waits for S_ij alone (`wgmma.wait_group 1`), computes the softmax, and only
then waits for P V (`wgmma.wait_group 0`). The PTX says so; the SASS need not: ptxas may move the
last wait up. This compiles a rung's configuration with NVRTC, disassembles it (nvdisasm: the device
machine has it, with the CUDA toolkit), finds the steady step (the largest batch of HGMMA, QGMMA for e4m3,
issued after one WARPGROUP.ARRIVE: S and P V together) and counts that step's MUFU.EX2 issued before its
`WARPGROUP.DEPBAR.LE gsb0, 0x0`, which run under the products, and after it, which do not:

    python3 tools/wgmma_waits.py v24 --config 128,128,128,0 --config 64,192,128,0
    python3 tools/wgmma_waits.py v29 --config 128,128,224
    python3 tools/wgmma_waits.py --sass saved.sass              a listing saved earlier, no nvdisasm
    python3 tools/wgmma_waits.py v34 --config 64,192,128,0 --mix   and the instructions of the loop
                                                                  around that step, by opcode
    python3 tools/wgmma_waits.py b07 --config 64,128,128,0,0 --phase backward_dk_dv --mix
                                                                  a backward rung's phase the same way

(docs/ladder.md#v29: in v24 and v29 every exponential of the step comes after that wait;
docs/ladder.md#pinned-softmax: why, and a store of the row sums before the wait that keeps them ahead of it.)
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_OP = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(WARPGROUP\.ARRIVE|WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d+)|[HQ]GMMA|MUFU\.EX2)")


def events(sass: str) -> list[tuple[int, str]]:
    """(address, what) in program order: 'arrive', 'gmma', 'wait N' (wgmma groups left pending), 'ex2'."""
    out = []
    for line in sass.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        op = m.group(2)
        kind = ("arrive" if op == "WARPGROUP.ARRIVE" else f"wait {int(m.group(3), 16)}" if op.startswith("WARPGROUP.DEPBAR")
                else "gmma" if op.endswith("GMMA") else "ex2")
        out.append((int(m.group(1), 16), kind))
    return out


@dataclass
class Step:
    products: int  # HGMMA or QGMMA issued after the step's one arrive
    arrive: int  # addresses
    wait_one: int | None
    wait_all: int | None
    overlapped: int  # exponentials between the arrive and the wait for every product
    after: int  # exponentials after it, before the next arrive

    def verdict(self) -> str:
        if self.wait_all is None:
            return "no wait for every product before the next batch"
        total = self.overlapped + self.after
        if not total:
            return "no exponentials in the step"
        return (f"{self.overlapped} of {total} exponentials before the wait for every product"
                + (": the softmax does not overlap the step's last products" if not self.overlapped else ""))


def steady_step(evs: list[tuple[int, str]]) -> Step | None:
    """The step whose arrive issues the most products (ties: the last, since a loop's peeled first step
    comes before it), with its waits and exponentials."""
    batches = []  # (index of the arrive, products after it before anything else)
    for i, (_, kind) in enumerate(evs):
        if kind == "arrive":
            n = 0
            for _, k in evs[i + 1:]:
                if k != "gmma":
                    break
                n += 1
            batches.append((i, n))
    if not batches:
        return None
    start, products = max(batches, key=lambda b: (b[1], b[0]))
    wait_one = wait_all = None
    overlapped = after = 0
    for address, kind in evs[start + 1 + products:]:
        if kind == "arrive":
            break
        if kind == "wait 1" and wait_one is None and wait_all is None:
            wait_one = address
        elif kind == "wait 0" and wait_all is None:
            wait_all = address
        elif kind == "ex2":
            if wait_all is None:
                overlapped += 1
            else:
                after += 1
    return Step(products, evs[start][0], wait_one, wait_all, overlapped, after)


_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*?(\.L_x_\d+)?\W*;")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")


@dataclass
class Loop:
    start: int  # the address a backward branch after the step jumps to
    end: int  # that branch
    ops: dict[str, int]  # opcode (without its modifiers) -> instructions in [start, end], most first

    def summary(self) -> str:
        listed = ", ".join(f"{op} {n}" for op, n in self.ops.items())
        return f"loop {self.start:#x}-{self.end:#x}: {sum(self.ops.values())} instructions: {listed}"


def step_loop(sass: str, arrive: int) -> Loop | None:
    """The loop around the steady step: from the first backward branch after its arrive (a BRA to a label
    at or before it) back to that label, every instruction of the body counted by opcode, whichever
    path a step takes (the mask's and the rescale's included)."""
    labels, pending, instructions = {}, [], []
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            pending.append(m.group(1))
        elif m := _INSTRUCTION.match(line):
            address = int(m.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            instructions.append((address, m.group(2), m.group(3)))
    for address, op, target in instructions:
        if address > arrive and op == "BRA" and target in labels and labels[target] <= arrive:
            body = [o for a, o, _ in instructions if labels[target] <= a <= address]
            counts = {o: body.count(o) for o in sorted(set(body), key=lambda o: (-body.count(o), o))}
            return Loop(labels[target], address, counts)
    return None


def nvdisasm() -> str | None:
    """nvdisasm on the PATH, in the CUDA toolkit, or from the nvidia-cuda-nvdisasm wheel (the test extra's):
    the listing needs no GPU."""
    toolkit = Path("/usr/local/cuda/bin/nvdisasm")
    if found := shutil.which("nvdisasm") or (str(toolkit) if toolkit.exists() else None):
        return found
    try:
        import nvidia
    except ImportError:
        return None
    wheel = sorted(p for root in nvidia.__path__ for p in Path(root).glob("cu*/bin/nvdisasm"))
    return str(wheel[-1]) if wheel else None


def disassemble(cubin: bytes) -> str:
    tool = nvdisasm()
    if tool is None:
        raise SystemExit("nvdisasm not found: it comes with the CUDA toolkit (the device machine has it) and in "
                         "the nvidia-cuda-nvdisasm wheel (pip install -e '.[test]'); or pass --sass with a "
                         "listing saved there")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], check=True, capture_output=True, text=True).stdout


def load(kernel: str):
    """A forward rung, or a backward one (b05, b07_persistent or its path under kernels/backward)."""
    from kernels import backward, ladder

    path = Path(kernel)
    if backward.owns(kernel) or (path.suffix == ".cu" and path.resolve().parent == backward.BACKWARD_DIR):
        return backward.load(kernel)
    return ladder.load(kernel)


def entries(rung) -> list[str | None]:
    """The kernels a configuration compiles to: a backward rung's phases (backward_dk_dv, ...), or the
    forward rung's one (None)."""
    return [p.entry for p in getattr(rung, "phases", ())] or [None]


def compiled(kernel: str, config: str, arch: str, entry: str | None = None) -> tuple[str, bytes]:
    """One configuration (and, of a backward rung, one phase: `entry`, default its first) compiled here."""
    from kernels import nvrtc
    from kernels.reports import COMMON_OPTIONS
    from kernels.runtime import _as_config

    rung = load(kernel)
    cfg = _as_config(rung, config)
    if phases := getattr(rung, "phases", ()):
        phase = next((p for p in phases if entry in (None, p.entry)), None)
        if phase is None:
            raise SystemExit(f"{rung.name} has no phase {entry} (its phases: {', '.join(p.entry for p in phases)})")
        expression, name = rung.entry_expression(phase, cfg), f"{rung.name}:{phase.entry}"
    else:
        expression, name = rung.name_expression(cfg), rung.name
    cubin, _, _ = nvrtc.compile_cubin(rung.source, str(rung.path), [f"-arch={arch}", *COMMON_OPTIONS, *rung.options],
                                      [expression])
    described = ", ".join(f"{k}={v}" for k, v in rung.params(cfg).items())
    return f"{name} ({described})", cubin


def report(name: str, sass: str, mix: bool = False) -> str:
    step = steady_step(events(sass))
    if step is None:
        return f"{name}: no WARPGROUP.ARRIVE (not a wgmma kernel?)"
    where = lambda a: "-" if a is None else f"{a:#x}"  # noqa: E731
    text = (f"{name}: steady step at {step.arrive:#x}: {step.products} products, wait <= 1 at {where(step.wait_one)}, "
            f"wait 0 at {where(step.wait_all)}; {step.verdict()}")
    if mix:
        loop = step_loop(sass, step.arrive)
        text += "\n  " + (loop.summary() if loop else "no backward branch around the step")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", nargs="?", help="a rung (v24, v29_fp8_wide_keys, b07 or a .cu path)")
    ap.add_argument("--phase", help="of a backward rung, one phase (backward_dk_dv, ...; default: every phase)")
    ap.add_argument("--config", action="append", default=[], help="a configuration, as lab.configs writes it (repeatable; "
                    "default: every declared one)")
    ap.add_argument("--arch", default="sm_90", help="compile for (default sm_90; a rung's lab.options may say sm_90a)")
    ap.add_argument("--sass", type=Path, help="read this nvdisasm listing instead of compiling")
    ap.add_argument("--mix", action="store_true", help="also the loop around the steady step: its instructions by "
                    "opcode, every path of the body counted once (the mask's and the rescale's too)")
    args = ap.parse_args(argv)
    if args.sass:
        print(report(str(args.sass), args.sass.read_text(), args.mix))
        return 0
    if not args.kernel:
        ap.error("give a rung, or --sass")
    rung = load(args.kernel)
    configs = args.config or [",".join(map(str, c)) for c in rung.configs]
    for config in configs:
        for entry in [args.phase] if args.phase else entries(rung):
            name, cubin = compiled(args.kernel, config, args.arch, entry)
            print(report(name, disassemble(cubin), args.mix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
