"""Our flat-batch paged forward against transformers' own forward (the oracle).

Each sequence's logits at every computed position are compared with transformers run on that
sequence alone, unpadded, in fp32: ``max|ours - ref| / max|ref| <= 1e-4``.
"""

from __future__ import annotations

import pytest
import torch

from stencil.engine.models.llama import LlamaForCausalLM
from stencil.engine.models.loader import load_model
from stencil.engine.models.rope import RopeSpec, RopeTable, rope_cos_sin
from stencil.engine.models.architecture import LlamaSpec
from stencil.kernels.attention_backend import AttentionMetadata
from stencil.kernels.torch_ref import TorchAttentionBackend

BLOCK = 16
REL_TOL = 1e-4


class PagedBatch:
    """Sequences in a paged KV cache with shuffled, non-contiguous block ids; builds one flat
    step's tensors from a list of (sequence index, new tokens)."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 48, seed: int = 0, backend=None,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.backend = backend or TorchAttentionBackend()
        shape = (num_blocks, BLOCK, model.num_kv_heads, model.head_dim)
        dtype = kv_dtype or model.dtype
        self.caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                       for _ in range(model.num_layers)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tokens: list[list[int]] = []
        self.blocks: list[list[int]] = []

    def add(self) -> int:
        self.tokens.append([])
        self.blocks.append([])
        return len(self.tokens) - 1

    def step(self, work: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one flat step; returns fp32 logits ``[T, V]`` for every new token, in order."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, new in work:
            done = len(self.tokens[seq])
            self.tokens[seq].extend(new)
            total = len(self.tokens[seq])
            while len(self.blocks[seq]) * BLOCK < total:
                self.blocks[seq].append(self.free.pop())
            for p in range(done, total):
                slots.append(self.blocks[seq][p // BLOCK] * BLOCK + p % BLOCK)
            ids.extend(new)
            positions.extend(range(done, total))
            starts.append(starts[-1] + len(new))
            seq_lens.append(total)
        width = max(len(self.blocks[s]) for s, _ in work)
        tables = torch.zeros(len(work), width, dtype=torch.int32)
        for row, (seq, _) in enumerate(work):
            tables[row, : len(self.blocks[seq])] = torch.tensor(self.blocks[seq])
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(len(n) for _, n in work),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta, self.backend)
        assert hidden.shape == (len(ids), self.model.spec.hidden_size)
        return self.model.compute_logits(hidden)


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def assert_close_rel(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel <= REL_TOL, f"relative error {rel:.3g} > {REL_TOL}"


def load_pair(model_dir):
    from transformers import AutoModelForCausalLM

    ours, _ = load_model(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return ours, ref


def random_prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_decode_and_chunked_prefill_match_transformers(arch, tiny_model_factory):
    ours, ref = load_pair(tiny_model_factory(arch))
    vocab = ours.vocab_size
    batch = PagedBatch(ours, seed={"llama": 1, "qwen2": 2, "qwen3": 3}[arch])

    # (a) several prompts of different lengths in one flat prefill step.
    lengths = [7, 1, 33, 16]
    seqs = [batch.add() for _ in lengths]
    prompts = [random_prompt(n, 10 + i, vocab) for i, n in enumerate(lengths)]
    logits = batch.step(list(zip(seqs, prompts)))
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    for i, seq in enumerate(seqs):
        assert_close_rel(logits[offsets[i]:offsets[i + 1]], hf_logits(ref, batch.tokens[seq]))

    # (b) one decode token per sequence (the greedy choice), all in one step.
    nxt = [[int(logits[offsets[i + 1] - 1].argmax())] for i in range(len(seqs))]
    logits = batch.step(list(zip(seqs, nxt)))
    for i, seq in enumerate(seqs):
        assert_close_rel(logits[i:i + 1], hf_logits(ref, batch.tokens[seq])[-1:])

    # (c) chunked prefill of a new prompt (chunks 13 + 12, not block aligned), the second chunk
    # sharing its step with decodes of two running sequences.
    new = batch.add()
    prompt = random_prompt(25, 99, vocab)
    first = batch.step([(new, prompt[:13])])
    second = batch.step([(seqs[0], [5]), (new, prompt[13:]), (seqs[2], [6])])
    full = hf_logits(ref, prompt)
    assert_close_rel(first, full[:13])
    assert_close_rel(second[1:13], full[13:])
    assert_close_rel(second[:1], hf_logits(ref, batch.tokens[seqs[0]])[-1:])
    assert_close_rel(second[13:], hf_logits(ref, batch.tokens[seqs[2]])[-1:])


def test_sharded_checkpoint_and_untied_head_load(tiny_model_factory, tmp_path):
    """qwen2's tiny model has an untied LM head; re-saved in small shards it loads through
    the index file to the same logits as transformers."""
    _, ref = load_pair(tiny_model_factory("qwen2"))
    ref.save_pretrained(str(tmp_path), max_shard_size="4MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours, _ = load_model(tmp_path)
    assert ours.lm_head.weight is not ours.embed_tokens.weight
    batch = PagedBatch(ours)
    prompt = random_prompt(20, 3, ours.vocab_size)
    assert_close_rel(batch.step([(batch.add(), prompt)]), hf_logits(ref, prompt))


def test_llama3_rope_model_matches_transformers(default_model_dir, tmp_path):
    from conftest import make_tiny_model_dir

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = make_tiny_model_dir(tmp_path, default_model_dir, "llama", rope_parameters=rope)
    ours, ref = load_pair(model_dir)
    assert ours.spec.rope.rope_type == "llama3"
    batch = PagedBatch(ours)
    prompt = random_prompt(40, 4, ours.vocab_size)
    assert_close_rel(batch.step([(batch.add(), prompt)]), hf_logits(ref, prompt))


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
])
def test_rope_tables_match_transformers(rope_parameters):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=4096,
                         rope_parameters=rope_parameters)
    positions = torch.tensor([[0, 1, 7, 100, 1000, 4095]])
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_cos_sin(RopeSpec.from_hf_config(config), 128, 4096)
    # transformers stores both halves (the same values twice).
    torch.testing.assert_close(cos[positions[0]], ref_cos[0, :, :64], atol=0, rtol=0)
    torch.testing.assert_close(sin[positions[0]], ref_sin[0, :, :64], atol=0, rtol=0)


@pytest.mark.parametrize("theta,head_dim,limit", [(1e6, 256, 32768), (1e4, 80, 5000)])
def test_rope_table_grows_on_demand_with_the_full_tables_bits(theta, head_dim, limit):
    """A CPU table holds only the positions asked for (in blocks), and a row's bits never depend
    on how the table grew: two tables grown in different orders, and the whole table computed at
    once, agree exactly."""
    spec = RopeSpec(theta=theta)
    full_cos, full_sin = rope_cos_sin(spec, head_dim, limit)
    a = RopeTable(spec, head_dim, limit, "cpu", torch.float32)
    b = RopeTable(spec, head_dim, limit, "cpu", torch.float32)
    assert len(a) == RopeTable.BLOCK
    gen = torch.Generator().manual_seed(3)
    for bound in (7, 1000, 1025, 2500, limit):  # a: grown step by step; b: at once
        pos = torch.randint(0, bound, (41,), generator=gen)
        cos, sin = a.lookup(pos)
        assert len(a) >= int(pos.max()) + 1 and len(a) % RopeTable.BLOCK in (0, limit % RopeTable.BLOCK)
        assert torch.equal(cos, full_cos[pos]) and torch.equal(sin, full_sin[pos])
    assert len(a) == limit
    b.lookup(torch.tensor([limit - 1]))
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin) and torch.equal(a.cos, full_cos)
    small = RopeTable(spec, head_dim, limit, "cpu", torch.float32)
    small.lookup(torch.tensor([1500]))
    assert len(small) == 2 * RopeTable.BLOCK  # two blocks, not the whole range
    with pytest.raises(IndexError):
        small.lookup(torch.tensor([limit]))


def test_unsupported_configs_raise_clear_errors(tmp_path):
    from transformers import GPT2Config, LlamaConfig

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"'gpt2'.*supported.*llama.*mistral.*qwen2.*qwen3"):
        load_model(tmp_path)
    yarn = LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        LlamaSpec.from_hf_config(yarn)


@pytest.mark.slow
def test_real_smollm2_prompt_and_decode_match_transformers(default_model_dir, tokenizer):
    ours, ref = load_pair(default_model_dir)
    prompt = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    batch = PagedBatch(ours, num_blocks=8)
    seq = batch.add()
    logits = batch.step([(seq, prompt)])
    assert_close_rel(logits, hf_logits(ref, prompt))
    logits = batch.step([(seq, [int(logits[-1].argmax())])])
    assert_close_rel(logits, hf_logits(ref, batch.tokens[seq])[-1:])


def test_tiny_mistral_masks_its_sliding_window_like_transformers(tmp_path):
    """Past the window (16 tokens), each layer attends to its last 16 positions only, through the
    backend's window: prompt, a chunk behind it and decode steps all match transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mistral", vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
        sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(tmp_path))
    ours, ref = load_pair(tmp_path)
    assert ours.max_context_len == 256 and all(layer.attn.window == 16 for layer in ours.layers)
    batch = PagedBatch(ours)
    prompt = random_prompt(50, 5, ours.vocab_size)
    seq = batch.add()
    assert_close_rel(batch.step([(seq, prompt[:20])]), hf_logits(ref, prompt[:20]))
    assert_close_rel(batch.step([(seq, prompt[20:])]), hf_logits(ref, prompt)[20:])
    for t in (7, 8, 9):
        assert_close_rel(batch.step([(seq, [t])]), hf_logits(ref, batch.tokens[seq])[-1:])
