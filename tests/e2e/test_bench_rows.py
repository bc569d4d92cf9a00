"""``stencil bench rows``: reading llama.cpp's ``test-backend-ops perf`` lines and the bytes a
matrix holds (running either kernel is the benchmark's job, not the suite's)."""

from __future__ import annotations

import pytest

from stencil.benchmarks import rows

LINE = ("  MUL_MAT(type_a={t},type_b=f32,m={m},n={n},k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1):"
        "                276 runs -  {us} us/run - 117.44 MFLOP/run - \x1b[1;34m 29.01 GFLOPS\x1b[0m")


def test_parse_runs_takes_the_one_row_cases_of_the_shape():
    text = "\n".join([LINE.format(t="q4_K", m=4096, n=1, us="4047.63"),
                      LINE.format(t="q8_0", m=4096, n=1, us="5100.00"),
                      LINE.format(t="q4_K", m=4096, n=8, us="9000.00"),   # eight rows: not this benchmark's
                      LINE.format(t="q6_K", m=2048, n=1, us="1.00"),      # another shape
                      "  Backend CPU: OK"])
    assert rows.parse_runs(text) == {"Q4_K": 4047.63, "Q8_0": 5100.0}


@pytest.mark.parametrize("qtype,name", [("Q4_K", "q4_K"), ("Q8_0", "q8_0"), ("Q5_0", "q5_0"), ("Q6_K", "q6_K")])
def test_ggml_spelling(qtype, name):
    assert rows.ggml_name(qtype) == name


def test_weight_bytes_are_the_blocks_of_the_shape():
    # 14336 weights a row: 56 Q4_K super-blocks of 144 bytes, 448 Q8_0 blocks of 34
    assert rows.weight_bytes("Q4_K") == 4096 * 56 * 144
    assert rows.weight_bytes("Q8_0") == 4096 * 448 * 34
