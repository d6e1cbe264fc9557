"""A tiny random-weight Llama, generated locally (no hub, no torch) for llama.cpp replicas in tests and the demo.

``ensure_tiny_model(spec, cache_dir)`` returns a ``TinyModel`` whose GGUF and HF directory exist; the output is a
pure function of the spec (byte-identical across runs), so it is cached under a directory named by its hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kvroute.policies.errors import ConfigError

GENERATOR_VERSION = 1
BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
GGUF_NAME = "model-f16.gguf"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the random Llama; ``small`` (7.4M params) is the CI preset, ``default`` (34M) the bench one."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 704
    vocab: int = 8192
    ctx: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "ctx"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"tiny_model.{key}", "must be a positive integer")
        if self.hidden % self.heads:
            raise ConfigError("tiny_model.heads", f"must divide hidden ({self.hidden})")
        if self.heads % self.kv_heads:
            raise ConfigError("tiny_model.kv_heads", f"must divide heads ({self.heads})")
        if (self.hidden // self.heads) % 2:
            raise ConfigError("tiny_model.heads", "head dimension hidden/heads must be even (rotary)")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of f16 K+V cache per token (what sizes llama.cpp's prompt cache per cached token)."""
        return self.layers * 2 * self.kv_heads * (self.hidden // self.heads) * 2

    def cache_ram_mib(self, tokens: int) -> int:
        """llama.cpp ``--cache-ram`` (MiB, at least 1) that holds ``tokens`` cached tokens of this model."""
        return max(1, math.ceil(tokens * self.kv_bytes_per_token / (1024 * 1024)))

    @property
    def digest(self) -> str:
        """Short content hash naming the cache entry."""
        blob = json.dumps({"v": GENERATOR_VERSION, **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


PRESETS: dict[str, TinyModelSpec] = {
    "small": TinyModelSpec(),
    "default": TinyModelSpec(hidden=512, layers=8, heads=8, kv_heads=8, ffn=1408),
}


@dataclass(frozen=True)
class TinyModel:
    """Paths of a generated model: ``gguf`` for llama.cpp, ``hf_dir`` for vLLM/transformers/tokenizers."""

    root: Path
    spec: TinyModelSpec

    @property
    def gguf(self) -> Path:
        return self.root / GGUF_NAME

    @property
    def hf_dir(self) -> Path:
        return self.root / "hf"

    @property
    def tokenizer_json(self) -> Path:
        return self.hf_dir / "tokenizer.json"


def default_cache_dir() -> Path:
    """Where generated models live unless the caller passes a directory (``KVROUTE_CACHE_DIR`` at the CLI)."""
    return Path.home() / ".cache" / "kvroute"


def ensure_tiny_model(spec: TinyModelSpec | None = None, cache_dir: Path | str | None = None) -> TinyModel:
    """Return the cached model for ``spec``, generating it first if absent; safe against concurrent callers."""
    spec = spec or PRESETS["small"]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = base / "tiny-model" / spec.digest
    model = TinyModel(root, spec)
    if (root / "done.json").exists():
        return model
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.digest}-", dir=root.parent))
    tmp.chmod(0o755)
    try:
        generate(spec, tmp)
        (tmp / "done.json").write_text(json.dumps({"generator": GENERATOR_VERSION, **asdict(spec)}, indent=1))
        try:
            tmp.rename(root)
        except OSError:
            if not (root / "done.json").exists():  # lost a race to a half-written dir? replace it
                shutil.rmtree(root, ignore_errors=True)
                tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model


def generate(spec: TinyModelSpec, out_dir: Path) -> None:
    """Write ``hf/`` (config, safetensors, tokenizer files) and the f16 GGUF into ``out_dir``."""
    hf_dir = out_dir / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec)
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    vocab_n = tokenizer.get_vocab_size()
    _write_json(hf_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "add_bos_token": False,
        "model_max_length": spec.ctx, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False})
    _write_json(hf_dir / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS})
    weights = _random_weights(spec, vocab_n)
    from safetensors.numpy import save_file

    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    _write_json(hf_dir / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn, "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "head_dim": spec.hidden // spec.heads, "vocab_size": vocab_n,
        "max_position_embeddings": spec.ctx, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float16", "bos_token_id": bos_id, "eos_token_id": eos_id})
    _write_json(hf_dir / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    _write_gguf(spec, out_dir / GGUF_NAME, tokenizer, weights)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1))


def stdlib_sources() -> list[Path]:
    """The Python standard library's top-level ``.py`` files, sorted: the tokenizer corpus and demo filler."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _train_tokenizer(spec: TinyModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = stdlib_sources()
    if not files:
        raise ConfigError("tiny_model.corpus", "no Python stdlib sources found to train the tokenizer on")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(f) for f in files], trainer)
    return tokenizer


def _random_weights(spec: TinyModelSpec, vocab_n: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(spec.seed)
    hd = spec.hidden // spec.heads

    def rnd(*shape: int):  # std 0.02 keeps activations finite through the random net
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    h = spec.hidden
    weights = {"model.embed_tokens.weight": rnd(vocab_n, h), "model.norm.weight": np.ones(h, np.float16),
               "lm_head.weight": rnd(vocab_n, h)}
    for i in range(spec.layers):
        pre = f"model.layers.{i}."
        weights[pre + "input_layernorm.weight"] = np.ones(h, np.float16)
        weights[pre + "post_attention_layernorm.weight"] = np.ones(h, np.float16)
        weights[pre + "self_attn.q_proj.weight"] = rnd(spec.heads * hd, h)
        weights[pre + "self_attn.k_proj.weight"] = rnd(spec.kv_heads * hd, h)
        weights[pre + "self_attn.v_proj.weight"] = rnd(spec.kv_heads * hd, h)
        weights[pre + "self_attn.o_proj.weight"] = rnd(h, spec.heads * hd)
        weights[pre + "mlp.gate_proj.weight"] = rnd(spec.ffn, h)
        weights[pre + "mlp.up_proj.weight"] = rnd(spec.ffn, h)
        weights[pre + "mlp.down_proj.weight"] = rnd(h, spec.ffn)
    return weights


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _rotary_permute(x, n_heads: int):
    """HF rotary row layout -> GGML's interleaved layout (the permutation llama.cpp's converter applies)."""
    return x.reshape(n_heads, 2, x.shape[0] // n_heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _write_gguf(spec: TinyModelSpec, path: Path, tokenizer, weights: dict) -> None:
    import gguf
    import numpy as np

    vocab_n = tokenizer.get_vocab_size()
    hd = spec.hidden // spec.heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("kvroute-tiny-random-llama")
    w.add_context_length(spec.ctx)
    w.add_embedding_length(spec.hidden)
    w.add_block_count(spec.layers)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab_n)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tj = json.loads(tokenizer.to_str())
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    for added in tj["added_tokens"]:
        by_id[added["id"]] = added["content"]
    specials = {added["id"] for added in tj["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([by_id[i] for i in range(vocab_n)])
    w.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(vocab_n)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(tokenizer.token_to_id(BOS))
    w.add_eos_token_id(tokenizer.token_to_id(EOS))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", weights["model.norm.weight"].astype(np.float32))
    w.add_tensor("output.weight", weights["lm_head.weight"])
    for i in range(spec.layers):
        for hf_name, gguf_name in _GGUF_NAMES.items():
            x = weights[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                x = _rotary_permute(x, spec.heads)
            elif gguf_name == "attn_k":
                x = _rotary_permute(x, spec.kv_heads)
            if x.ndim == 1:
                x = x.astype(np.float32)  # norms stay f32
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
