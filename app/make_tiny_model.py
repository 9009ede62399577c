#!/usr/bin/env python3
"""Build a random-weight Qwen3.5 3-label classifier checkpoint locally (no hub access needed).

Shapes:
  tiny         a few hundred thousand parameters; the embedded default for CPU demos and tests
  tiny-gdn64   tiny with linear-attention head dim 64, the smallest that sgl-kernel's CPU GDN
               kernels accept (SGLang's CPU engine)
  qwen3.5-4b   the text backbone of Qwen3.5-4B's published shape (32 layers, hidden 2560,
               3 GDN : 1 full attention, 16 q / 4 kv heads of dim 256, vocab 248320) for
               GPU benchmarks; its vision tower is reduced to a stub because text
               classification never runs it

The checkpoint is a real Transformers `Qwen3_5ForSequenceClassification` directory (config.json,
model.safetensors, tokenizer files) with labels contradiction/entailment/neutral in that order.
The tokenizer is a small byte-level BPE trained on the bundled NLI sample, so `text` requests and
`tokenize_nli.py` work offline. The weights are random: logits mean nothing, agreement does.

`--processor-out DIR` also writes stand-ins for the two base-model processor configs
(preprocessor_config.json, video_preprocessor_config.json) so the overlay step can run offline.

Example:
  python app/make_tiny_model.py build/demo/checkpoint --processor-out build/demo/base-processor
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

from openjev.common import LABELS, REPO_ROOT, UserError, atomic_write_json, run_main, utc_now

SAMPLE = REPO_ROOT / "data" / "nli_sample.jsonl"

# Text-backbone shapes. "qwen3.5-4b" follows the published Qwen3.5-4B text config. Every shape carries
# full_attention_interval beside layer_types, as the published Qwen3.5 configs do (SGLang reads the
# interval, Transformers layer_types; a config built from keyword arguments keeps the interval only
# when given).
SHAPES: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=32768, tie_word_embeddings=True,
        layer_types=["linear_attention"] * 3 + ["full_attention"], full_attention_interval=4,
    ),
    "qwen3.5-4b": dict(
        vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=262144, tie_word_embeddings=True,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8, full_attention_interval=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
}
# As tiny, with the linear-attention (GDN) key/value head dim 64: sgl-kernel's CPU GDN kernels
# accept head dims 64 and 128 only, so SGLang's CPU engine runs this one.
SHAPES["tiny-gdn64"] = dict(SHAPES["tiny"], layer_types=list(SHAPES["tiny"]["layer_types"]),
                            linear_key_head_dim=64, linear_value_head_dim=64)
# The vision tower is never run for text classification; keep it minimal in both shapes.
STUB_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                   temporal_patch_size=2, spatial_merge_size=2)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Stand-ins for Qwen3.5's processor configs (field names as Qwen3-VL-style processors use them).
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
VIDEO_PREPROCESSOR = {**PREPROCESSOR, "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2,
                      "size": {"shortest_edge": 4096, "longest_edge": 25165824}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="checkpoint directory to create (must not exist)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="backbone shape (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="weight and tokenizer seed (default: 0)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="dtype of the saved weights (default: float32)")
    p.add_argument("--device", default="cpu", help="where to initialise the weights, e.g. cuda (default: cpu)")
    p.add_argument("--processor-out", type=Path, default=None,
                   help="also write stand-in base-model processor configs into this new directory")
    return p


def text_corpus() -> list[str]:
    texts = []
    for line in SAMPLE.read_text().splitlines():
        row = json.loads(line)
        texts += [row["premise"], row["hypothesis"], row.get("instruction") or ""]
    return [t for t in texts if t]


def build_tokenizer(vocab_size: int):
    """A byte-level BPE of at most 512 entries, trained on the bundled NLI sample."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(512, vocab_size), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   model_max_length=SHAPES["qwen3.5-4b"]["max_position_embeddings"])


def build_config(shape: str, pad_token_id: int, eos_token_id: int):
    from transformers import Qwen3_5Config

    text = dict(SHAPES[shape], pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    cfg = Qwen3_5Config(
        text_config=text, vision_config=STUB_VISION, num_labels=3,
        id2label=dict(enumerate(LABELS)), label2id={label: i for i, label in enumerate(LABELS)},
        architectures=["Qwen3_5ForSequenceClassification"], tie_word_embeddings=text["tie_word_embeddings"],
    )
    cfg.pad_token_id = pad_token_id
    return cfg


def build_model(cfg, seed: int, dtype: str, device: str):
    import torch
    from transformers import Qwen3_5ForSequenceClassification

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForSequenceClassification(cfg)
    # A head whose logits are O(1) makes agreement and tie checks meaningful on random weights.
    with torch.no_grad():
        hidden = cfg.get_text_config().hidden_size
        model.score.weight.normal_(0.0, 1.0 / math.sqrt(hidden))
    return model.to(getattr(torch, dtype)).eval()


def write_processor_configs(out: Path) -> None:
    out.mkdir(parents=True)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR, indent=2) + "\n")


def main() -> int:
    args = build_parser().parse_args()
    for path in filter(None, (args.out, args.processor_out)):
        if path.exists():
            raise UserError(f"{path} already exists; refusing to overwrite it")
    tokenizer = build_tokenizer(SHAPES[args.shape]["vocab_size"])
    cfg = build_config(args.shape, tokenizer.pad_token_id, tokenizer.eos_token_id)
    print(f"building {args.shape} Qwen3.5 classifier (seed {args.seed}, {args.dtype}, on {args.device})",
          file=sys.stderr)
    model = build_model(cfg, args.seed, args.dtype, args.device)
    staging = args.out.with_name(f".{args.out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        n_params = sum(p.numel() for p in model.parameters())
        atomic_write_json(staging / "openjev_random_model.json", {
            "made_by": "app/make_tiny_model.py", "made_at": utc_now(), "shape": args.shape, "seed": args.seed,
            "dtype": args.dtype, "parameters": n_params,
            "note": "random weights, not a trained model: logits are meaningless, agreement between backends is not",
        })
        staging.rename(args.out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if args.processor_out:
        write_processor_configs(args.processor_out)
    print(f"wrote {args.out} ({n_params:,} parameters)")
    return 0


if __name__ == "__main__":
    run_main(main)
