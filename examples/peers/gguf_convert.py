"""Converts an HF checkpoint to GGUF with the converter vendored in the llama-cpp-python sdist.

    python gguf_convert.py LLAMA_SRC MODEL_DIR OUT.gguf OUTTYPE

A staging directory links the weights and copies every other file, so nothing written there (the
tokenizer below) can reach the checkpoint through a link. The benchmark checkpoints ship no tokenizer:
then a small byte-level BPE one is added (the converter pads the vocabulary to vocab_size). Its
pre-tokenizer hash is unknown to the converter, which refuses it; any known BPE pre-tokenizer is fine
for throughput runs, so "gpt-2" is declared. OUT.gguf appears only when complete (written beside it,
then renamed): a killed conversion never leaves a truncated GGUF that later runs would take as done."""
import json
import os
import shutil
import sys
import tempfile


def train_tokenizer(model_dir: str, out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    vocab = min(512, json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"])
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)


def stage(model_dir: str, out: str) -> str:
    for name in os.listdir(model_dir):
        src, dst = os.path.join(os.path.abspath(model_dir), name), os.path.join(out, name)
        if name.endswith(".safetensors"):
            os.symlink(src, dst)  # read only; GBs
        elif os.path.isfile(src):
            shutil.copy(src, dst)  # small; a copy, so the converter's side can never write into the checkpoint
    if not any(os.path.exists(os.path.join(out, f)) for f in ("tokenizer.json", "tokenizer.model")):
        train_tokenizer(model_dir, out)
    return out


def main():
    src, model_dir, out_file, outtype = sys.argv[1:5]
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    import convert_hf_to_gguf as conv

    try:  # 0.3.36 keeps the model classes in a package beside the script; older ones inline them
        from conversion.base import TextModel as base
    except ImportError:
        base = getattr(conv, "TextModel", None) or getattr(conv, "Model")
    base.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    tmp_file = out_file + ".tmp"
    with tempfile.TemporaryDirectory() as tmp:
        sys.argv = ["convert_hf_to_gguf.py", stage(model_dir, tmp), "--outfile", tmp_file, "--outtype", outtype]
        conv.main()
    os.replace(tmp_file, out_file)


if __name__ == "__main__":
    main()
