"""The native kernels' C ABI is written once (`kernels/cpu/plait_cpu.h`): these tests fail on
any mismatch between the header, the compiled library, the C sources and the Python side."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest
import torch

from plait.kernels.cpu import build, native
from plait.kernels.cpu.build import ABI, AbiError, parse_header

HEADER_TEXT = build.HEADER.read_text()


def _needs_library() -> ctypes.CDLL:
    """The compiled kernels; skips where this machine cannot build them (not x86-64, no C
    compiler, torch with another OpenMP runtime), FAILS where it can and the build or the
    load failed (a definition disagreeing with the header, a warning, a missing export)."""
    problem = build.build_environment_problem()
    if problem is not None:
        pytest.skip(f"native CPU kernels cannot be built here: {problem}")
    lib = build.library()
    assert lib is not None, f"the kernels should build here: {build.unavailable_reason()}"
    return lib


def _source_exports() -> set[str]:
    """Names of the non-static `plait_*` functions the C sources define: a `plait_*(...)`
    whose balanced parameter list is followed by a body, `static` not in its head (the text
    since the previous `;` or `}`)."""
    names = set()
    for path in build.SOURCES:
        text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
        text = re.sub(r"^\s*#.*$", " ", text, flags=re.M)  # preprocessor lines
        for match in re.finditer(r"\b(plait_\w+)\s*\(", text):
            depth, at = 1, match.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[at], 0)
                at += 1
            if not text[at:].lstrip().startswith("{"):
                continue  # a call or a declaration
            head = text[max(text.rfind(";", 0, match.start()),
                            text.rfind("}", 0, match.start())) + 1:match.start()]
            if "static" not in re.findall(r"\w+", head):
                names.add(match[1])
    return names


# --- (a) the header, the sources and the library declare / define / export the same set ---


def test_header_declares_every_function_the_sources_define() -> None:
    expected = {"plait_lanes", "plait_gemm", "plait_decode_attention", "plait_rope_write_kv",
                "plait_add_rms_norm", "plait_silu_mul", "plait_silu_mul_bf16",
                "plait_sample_inverse_cdf", "plait_decoder_stack", "plait_qgemm",
                "plait_dequantize", "plait_dequantize_bf16", "plait_repack_isa",
                "plait_repack_amx_state", "plait_repack_bytes", "plait_repack",
                "plait_repack_gemm", "plait_repack_dequantize", "plait_repack_prompt_bf16",
                "plait_repack_gemm_bf16", "plait_repack_gemm_bf16_silu",
                "plait_repack_gemm_silu", "plait_attention_amx"}
    assert set(ABI.functions) == expected
    assert _source_exports() == expected


def test_every_source_includes_the_abi_header_and_repeats_no_constant() -> None:
    for path in build.SOURCES:
        text = path.read_text()
        assert '#include "plait_cpu.h"' in text, path.name
        for name in ("MAX_QUERIES", "MAX_HEAD_DIM", "MAX_BLOCK", "NATIVE_MAX_ROWS"):
            assert not re.search(rf"#define\s+{name}\b", text), (path.name, name)
        assert not re.search(r"\bL_[A-Z_]+\b", text), f"{path.name}: a second stack enum"
    assert "plait_" not in re.sub(r"/\*.*?\*/", "", (build.HEADERS[1]).read_text(), flags=re.S)
    assert build.HEADER in build.HEADERS


def test_library_exports_exactly_the_declared_functions_with_generated_signatures() -> None:
    lib = _needs_library()
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no `nm` to list the library's dynamic symbols")
    listed = subprocess.run([nm, "-D", "--defined-only", lib._name], capture_output=True,
                            text=True, check=True, timeout=60).stdout
    exported = {line.split()[-1] for line in listed.splitlines()
                if line.split() and line.split()[-1].startswith("plait_")}
    assert exported == set(ABI.functions)
    c_types = {"long": ctypes.c_long, "int": ctypes.c_int, "float": ctypes.c_float}
    for name, (ret, params) in ABI.functions.items():
        fn = getattr(lib, name)
        assert fn.restype is c_types[ret]
        assert list(fn.argtypes) == [ctypes.c_void_p if p.endswith("*") else c_types[p]
                                     for p in params], name
    # spot checks against the C, independent of the parser
    assert len(lib.plait_decode_attention.argtypes) == 22
    assert len(lib.plait_rope_write_kv.argtypes) == 18
    assert len(lib.plait_decoder_stack.argtypes) == 26
    assert lib.plait_lanes.argtypes == []
    assert len(lib.plait_qgemm.argtypes) == 8 and len(lib.plait_dequantize.argtypes) == 5
    assert ABI.functions["plait_silu_mul"] == (
        "int", ("const float *", "long", "long", "long", "float *"))


# --- (b) the parser refuses what it cannot read -------------------------------------------

_GOOD = HEADER_TEXT


@pytest.mark.parametrize("bad", [
    _GOOD.replace("long inter,", "unsigned long inter,"),  # a type it does not know
    _GOOD.replace("long inter,", "double inter,"),
    _GOOD.replace("long inter,", "long,"),  # a parameter without a name
    _GOOD.replace("int64_t *out);", "char *out);"),  # pointer to another type
    _GOOD.replace("const int64_t *desc, long K,", "const double *desc, long K,"),
    _GOOD.replace("const int64_t *desc, long K,", "const uint8_t *desc, long K,"),
    _GOOD.replace("int plait_lanes(void);", "int plait_lanes(void)"),  # missing ';'
    _GOOD.replace("int plait_lanes(void);", "int plait_lanes(void); int helper(long x);"),
    _GOOD.replace("int plait_lanes(void);",
                  "int plait_lanes(void) __attribute__((const));"),
    _GOOD.replace("#define PLAIT_MAX_QUERIES 48", "#define PLAIT_MAX_QUERIES (6 * 8)"),
    _GOOD.replace("#define PLAIT_MAX_QUERIES 48", "#define MAX_QUERIES 48"),
    _GOOD.replace("#include <stdint.h>", "#include <stdint.h>\n#if 1\n#endif"),
    _GOOD.replace("PLAIT_STACK_QKV_BIAS,", "PLAIT_STACK_QKV_BIAS = 2,"),
    _GOOD.replace("  PLAIT_STACK_POINTERS\n", ""),
    _GOOD.replace("#endif /* PLAIT_CPU_H */", "typedef long plait_size;\n#endif"),
    _GOOD.replace("#endif /* PLAIT_CPU_H */", "#endif // PLAIT_CPU_H"),
    _GOOD + "int plait_gemm(long x);\n",  # declared twice (and after the guard)
])
def test_parser_raises_on_what_it_cannot_parse(bad: str) -> None:
    assert bad != _GOOD
    with pytest.raises(AbiError):
        parse_header(bad)


def test_parser_reads_a_minimal_header() -> None:
    abi = parse_header("""/* c */
#ifndef PLAIT_CPU_H
#define PLAIT_CPU_H
#define PLAIT_A -2
enum e { PLAIT_STACK_X, PLAIT_STACK_Y_Z, PLAIT_STACK_POINTERS };
int plait_f(const float *a, long n, float s, int32_t *b,
            int k);  /* two lines */
int plait_h(const uint16_t *a, uint16_t *b);
void plait_g(void);
#endif
""")
    assert abi.constants == {"PLAIT_A": -2}
    assert abi.stack_pointers == ("x", "y_z")
    assert abi.functions == {"plait_f": ("int", ("const float *", "long", "float", "int32_t *",
                                                 "int")),
                             "plait_h": ("int", ("const uint16_t *", "uint16_t *")),
                             "plait_g": ("void", ())}


# --- (c) the constants Python uses are the header's ----------------------------------------


def test_python_constants_are_the_headers() -> None:
    constants = ABI.constants
    assert native.MAX_QUERIES == build.MAX_QUERIES == constants["PLAIT_MAX_QUERIES"] == 48
    assert build.MAX_HEAD_DIM == constants["PLAIT_MAX_HEAD_DIM"] == 256
    assert build.MAX_BLOCK == constants["PLAIT_MAX_BLOCK"] == 256
    assert build.NATIVE_MAX_ROWS == constants["PLAIT_NATIVE_MAX_ROWS"] == 24
    assert (constants["PLAIT_OK"], constants["PLAIT_ERR_SHAPES"],
            constants["PLAIT_ERR_NOMEM"]) == (0, -1, -2)
    assert native.STACK_POINTERS == build.STACK_POINTERS == ABI.stack_pointers == (
        "input_norm", "qkv_weight", "qkv_bias", "o_weight", "post_norm", "gate_up_weight",
        "down_weight", "k_cache", "v_cache", "k_offset")
    # the enum as the C compiler numbers it: the header text, in order
    enum = re.findall(r"^\s*PLAIT_STACK_(\w+)", HEADER_TEXT, flags=re.M)
    assert tuple(n.lower() for n in enum) == (*native.STACK_POINTERS, "pointers")


def test_ggml_type_ids_are_ggufs() -> None:
    """The descriptor's type ids in the header are gguf-py's (quant.py's), F32 aside (it
    means plait_gemm's panels, native.F32_PANELS)."""
    from plait.kernels.cpu import quant

    header = {name.removeprefix("PLAIT_GGML_"): value
              for name, value in ABI.constants.items() if name.startswith("PLAIT_GGML_")}
    assert header.pop("F32") == native.F32_PANELS == 0
    assert header == {quant.type_name(t): t for t in quant.KEPT_TYPES}


def test_supports_attention_uses_the_header_limits() -> None:
    _needs_library()
    lanes = native.lanes()
    native.supports_attention.cache_clear()
    assert native.supports_attention(8, 2, build.MAX_HEAD_DIM, build.MAX_BLOCK)
    assert not native.supports_attention(8, 2, build.MAX_HEAD_DIM + lanes, 16)
    assert not native.supports_attention(8, 2, 64, build.MAX_BLOCK + 1)


# --- (d) calls through the generated signatures give torch's results ----------------------


def test_kernels_through_generated_signatures_match_torch() -> None:
    _needs_library()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 72, generator=gen)
    w = torch.randn(37, 72, generator=gen)
    bias = torch.randn(37, generator=gen)
    y = native.gemm(x, native.pack_weight(w), 37, bias)
    want = x.double() @ w.double().T + bias.double()
    assert (y.double() - want).abs().max().item() < 1e-4

    gate_up = torch.randn(3, 2 * 41, generator=gen)
    gate, up = gate_up.double().chunk(2, dim=1)
    got = native.silu_mul(gate_up)
    assert (got.double() - torch.nn.functional.silu(gate) * up).abs().max().item() < 1e-5

    xs, add, weight = (torch.randn(4, 96, generator=gen), torch.randn(4, 96, generator=gen),
                       torch.randn(96, generator=gen))
    total, normed = native.add_rms_norm(xs, add, weight, 1e-6)
    s = xs.double() + add.double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert (total.double() - s).abs().max().item() < 1e-6
    assert (normed.double() - want).abs().max().item() < 1e-4


def test_return_codes_follow_the_header_convention() -> None:
    lib = _needs_library()
    shapes = ABI.constants["PLAIT_ERR_SHAPES"]
    out = torch.empty(8)
    assert lib.plait_silu_mul(out.data_ptr(), 8, -1, 4, out.data_ptr()) == shapes
    assert lib.plait_silu_mul_bf16(out.data_ptr(), 8, 2, -4, out.data_ptr()) == shapes
    assert lib.plait_add_rms_norm(out.data_ptr(), 8, None, 0, out.data_ptr(), 1, -1, 1e-6, None,
                                  out.data_ptr()) == shapes
    f32, bf16 = ABI.constants["PLAIT_KV_F32"], ABI.constants["PLAIT_KV_BF16"]
    # a rotated width odd, zero, or past the head: refused before anything is read
    for head_dim, rot_dim in ((3, 3), (4, 3), (4, 0), (4, 6)):
        assert lib.plait_rope_write_kv(*(None, 0) * 3, 0, 1, 1, head_dim, rot_dim,
                                       *(None,) * 4, f32, None, None) == shapes
    # a KV element type the kernels do not know: refused before anything is read
    assert lib.plait_rope_write_kv(*(None, 0) * 3, 0, 1, 1, 2, 2, *(None,) * 4, 7,
                                   None, None) == shapes
    # attention: a head_dim beyond PLAIT_MAX_HEAD_DIM is refused before anything is read
    lanes = native.lanes()
    assert lib.plait_decode_attention(
        None, 0, None, None, bf16, 16, 1, 1, build.MAX_HEAD_DIM + lanes, None, 0, 0, None,
        None, None, None, None, 1.0, 0, 0.0, None, None) == shapes
    assert lib.plait_decode_attention(
        None, 0, None, None, 7, 16, 1, 1, lanes, None, 0, 0, None, None, None, None, None,
        1.0, 0, 0.0, None, None) == shapes
    # a negative window or softcap (a NaN softcap too)
    for window, softcap in ((-1, 0.0), (0, -1.0), (0, float("nan"))):
        assert lib.plait_decode_attention(
            None, 0, None, None, f32, 16, 1, 1, lanes, None, 0, 0, None, None, None, None,
            None, 1.0, window, softcap, None, None) == shapes


# --- (e) the build refuses warnings and a definition that disagrees with the header ------


def test_build_flags_refuse_warnings() -> None:
    assert {"-Wall", "-Werror", "-Wmissing-prototypes"} <= set(build.FLAGS)


def test_a_definition_disagreeing_with_the_header_does_not_compile(tmp_path) -> None:
    _needs_library()
    cc = os.environ.get("CC", "cc")
    for path in (*build.HEADERS, *build.SOURCES):
        shutil.copy(path, tmp_path / path.name)
    flags = [f for f in build.FLAGS if f != "-shared"]

    def syntax_ok(source: str) -> bool:
        done = subprocess.run([cc, *flags, "-fsyntax-only", source], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        return done.returncode == 0

    assert all(syntax_ok(path.name) for path in build.SOURCES)
    header = tmp_path / build.HEADER.name
    header.write_text(HEADER_TEXT.replace(
        "int plait_silu_mul(const float *gate_up, long gu_stride, long num_tokens, long inter,",
        "int plait_silu_mul(const float *gate_up, long gu_stride, long num_tokens, int inter,"))
    assert header.read_text() != HEADER_TEXT
    assert not syntax_ok("rowwise.c")  # conflicting types
    header.write_text(HEADER_TEXT.replace("int plait_lanes(void);", ""))
    assert not syntax_ok("gemm.c")  # -Wmissing-prototypes -Werror: an undeclared export
