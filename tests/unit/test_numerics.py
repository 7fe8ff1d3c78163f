"""`--numerics`: how each mode resolves (engine/numerics.py), what it sets, the errors where
a mode cannot run, and the CLI around it (`--exact`, the replaced flags refused by name)."""

from __future__ import annotations

import pytest
import torch

from plait.cli import REPLACED_FLAGS, EnvError, build_parser, engine_config
from plait.engine.config import EngineConfig
from plait.engine.numerics import resolve_numerics

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16 = torch.float32, torch.bfloat16


def test_auto_is_int8_only_for_a_gguf_file_on_a_vnni_cpu_engine() -> None:
    mode = resolve_numerics("auto", CPU, F32, native=True, vnni=True)
    assert (mode.name, mode.compute_dtype, mode.kv_dtype, mode.repacked) == \
        ("int8", BF16, BF16, True)
    assert "repacked" in mode.describe() and "auto" in mode.describe()
    cases = {
        "not a float32 CPU engine": dict(device=CUDA, dtype=BF16, native=False, vnni=False),
        "no native CPU kernels": dict(device=CPU, dtype=F32, native=False, vnni=False),
        "--weights float32": dict(device=CPU, dtype=F32, native=True, vnni=True, kept=False),
        "a checkpoint": dict(device=CPU, dtype=F32, native=True, vnni=True, gguf=False),
        "no AVX512-VNNI": dict(device=CPU, dtype=F32, native=True, vnni=False),
    }
    for why, where in cases.items():
        mode = resolve_numerics("auto", **where)  # type: ignore[arg-type]
        assert (mode.name, mode.compute_dtype, mode.kv_dtype, mode.repacked) == \
            ("exact", F32, None, False)
        assert why in mode.why


def test_asked_modes_set_their_arithmetic() -> None:
    bf16 = resolve_numerics("bf16", CPU, F32, native=True, vnni=False, gguf=False)
    assert (bf16.compute_dtype, bf16.kv_dtype, bf16.repacked, bf16.why) == \
        (BF16, BF16, False, "asked for")
    exact = resolve_numerics("exact", CUDA, BF16, native=False, vnni=False)
    assert (exact.compute_dtype, exact.kv_dtype, exact.repacked) == (F32, None, False)
    int8 = resolve_numerics("int8", CPU, F32, native=True, vnni=True, gguf=False)
    assert int8.repacked and int8.compute_dtype == BF16


@pytest.mark.parametrize(("mode", "where", "message"), [
    ("int8", dict(device=CPU, dtype=F32, native=True, vnni=False), "needs a CPU with AVX512"),
    ("bf16", dict(device=CUDA, dtype=BF16, native=False, vnni=False), "float32 CPU engine"),
    ("int8", dict(device=CPU, dtype=BF16, native=True, vnni=True), "float32 CPU engine"),
    ("bf16", dict(device=CPU, dtype=F32, native=False, vnni=False), "native CPU kernels"),
    ("int8", dict(device=CPU, dtype=F32, native=True, vnni=True, kept=False),
     "--weights float32"),
    ("fast", dict(device=CPU, dtype=F32, native=True, vnni=True), "must be one of"),
])
def test_a_mode_that_cannot_run_is_an_error(mode: str, where: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_numerics(mode, **where)


def test_config_default_and_bad_value() -> None:
    assert EngineConfig().numerics == "auto"
    with pytest.raises(ValueError, match=r"numerics must be one of \('auto', 'int8', 'bf16'"):
        EngineConfig(numerics="int4")


def test_cli_numerics_and_exact() -> None:
    parser = build_parser({})
    assert engine_config(parser.parse_args(["serve"])).numerics == "auto"
    assert engine_config(parser.parse_args(["serve", "--exact"])).numerics == "exact"
    assert engine_config(parser.parse_args(["serve", "--numerics", "bf16"])).numerics == "bf16"
    env = build_parser({"PLAIT_NUMERICS": "int8"})
    assert engine_config(env.parse_args(["serve"])).numerics == "int8"
    assert engine_config(env.parse_args(["serve", "--exact"])).numerics == "exact"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--numerics", "fp8"])


@pytest.mark.parametrize("flag", sorted(REPLACED_FLAGS))
def test_replaced_flags_are_refused_naming_the_new_one(flag: str, capsys) -> None:
    value = ["bfloat16"] if flag == "--compute-dtype" else []
    with pytest.raises(SystemExit) as exit_info:
        build_parser({}).parse_args(["serve", flag, *value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} was replaced: use --numerics" in err
    variable = "PLAIT_" + flag.removeprefix("--").replace("-", "_").upper()
    with pytest.raises(EnvError, match=f"{variable} is no longer read: use --numerics"):
        build_parser({variable: "1"})
