"""The GGUF files of the model benchmarks (``stencil.benchmarks.gguf_models``): the F32 copy keeps every
metadata key and decodes every tensor exactly; the random Llama has the asked shapes and a
vocabulary padded with control tokens. (``llama-quantize`` itself is not built in tests.)"""

from __future__ import annotations

import numpy as np
import pytest

from stencil.benchmarks import gguf_models
from gguf_testing import smol_vocab, write_tiny_gguf


@pytest.fixture(scope="module")
def smol_gguf():
    from stencil.engine.models.default_model import fetch_gguf

    return fetch_gguf()


def test_dequantized_copy_keeps_metadata_and_decodes_every_tensor(tmp_path, smol_gguf):
    import gguf
    from gguf.quants import dequantize

    src, _ = write_tiny_gguf(tmp_path / "q.gguf", "llama", smol_vocab(smol_gguf),
                             quant={"attn_q.weight": "Q4_1", "ffn_down.weight": "Q8_0", "ffn_up.weight": "Q4_K"},
                             hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    dst = gguf_models.dequantized_copy(src, tmp_path / "f32.gguf")
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    keep = {k for k in a.fields if not k.startswith("GGUF.") and k != "general.file_type"}
    assert keep <= set(b.fields)
    for k in keep:
        assert b.fields[k].contents() == a.fields[k].contents(), k
    assert b.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    src_tensors = {t.name: t for t in a.tensors}
    assert {t.name for t in b.tensors} == set(src_tensors)
    kinds = {t.tensor_type.name for t in a.tensors}
    assert {"Q4_1", "Q8_0", "Q4_K", "F32"} <= kinds
    for t in b.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        want = np.asarray(dequantize(src_tensors[t.name].data, src_tensors[t.name].tensor_type), np.float32)
        assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), t.name
        assert list(t.shape) == list(src_tensors[t.name].shape)


def test_random_llama_has_the_shapes_and_a_padded_vocabulary(tmp_path, smol_gguf):
    import gguf

    from stencil.engine.models.gguf_config import read_gguf_info
    from stencil.engine.models.gguf_file import GgufFile

    n_smol = len(GgufFile(smol_gguf).metadata["tokenizer.ggml.tokens"])
    cfg = {**gguf_models.LLAMA_1B, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128,
           "vocab": n_smol + 24}
    path = gguf_models.random_llama(smol_gguf, tmp_path / "r.gguf", cfg)
    info = read_gguf_info(path)
    assert (info.spec.hidden_size, info.spec.num_layers, info.spec.num_heads, info.spec.num_kv_heads,
            info.spec.intermediate_size, info.spec.vocab_size, info.spec.tie_word_embeddings) == \
        (64, 2, 4, 2, 128, n_smol + 24, True)
    f = GgufFile(path)
    tokens, types = f.metadata["tokenizer.ggml.tokens"], list(f.metadata["tokenizer.ggml.token_type"])
    assert len(tokens) == n_smol + 24 and tokens[-1] == "<|reserved_special_token_23|>"
    assert set(types[n_smol:]) == {int(gguf.TokenType.CONTROL)}
    emb = f.tensors["token_embd.weight"]
    assert emb.tensor_type.name == "F16" and "output.weight" not in f.tensors
    with pytest.raises(ValueError, match="smaller"):
        gguf_models.random_llama(smol_gguf, tmp_path / "s.gguf", {**cfg, "vocab": 100})
