"""Makes a tiny random-weight Llama that real vLLM can serve on CPU, offline.

No model hub is reachable, so the model is built here: a byte-level BPE tokenizer trained
with `tokenizers` on generated text, a chat template, and a Llama with random weights.
The text it writes is nonsense; its framing, scheduling and KV accounting are vLLM's own.

usage: python make_tiny_model.py OUT_DIR [--hidden 128] [--layers 2] [--heads 2] [--vocab 512]
"""

import argparse
import json
import os
import random


def corpus(n_lines: int, seed: int = 7):
    rng = random.Random(seed)
    syll = ["ka", "to", "ri", "mu", "sen", "lo", "va", "qui", "der", "an", "the", "of", "and",
            "token", "cache", "page", "stream", "gpu", "kv", "guard", "abort", "client"]
    for _ in range(n_lines):
        words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(4, 16))]
        yield " ".join(words) + rng.choice([".", "!", "?", ","]) + " " + str(rng.randint(0, 99999))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=4096)
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(args.out, exist_ok=True)
    special = ["<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(20000), trainer=trainer)

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    fast.model_max_length = args.max_len
    fast.save_pretrained(args.out)

    vocab = tok.get_vocab_size()
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.max_len,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    with open(os.path.join(args.out, "kvguard-tiny.json"), "w") as f:
        json.dump(vars(args) | {"vocab_actual": vocab}, f)
    print(f"tiny llama written to {args.out} (vocab {vocab}, hidden {args.hidden}, layers {args.layers})")


if __name__ == "__main__":
    main()
