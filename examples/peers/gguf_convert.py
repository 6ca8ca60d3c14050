"""Converts an HF checkpoint to GGUF with the converter vendored in the llama-cpp-python sdist.

    python gguf_convert.py LLAMA_SRC MODEL_DIR OUT.gguf OUTTYPE

The benchmark checkpoints ship no tokenizer, so a staging directory links the weights and adds a
small byte-level BPE tokenizer (the converter pads the vocabulary to vocab_size). Its pre-tokenizer
hash is unknown to the converter, which refuses it; any known BPE pre-tokenizer is fine for
throughput runs, so "gpt-2" is declared."""
import glob
import json
import os
import sys
import tempfile


def stage(model_dir: str, out: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    for f in glob.glob(os.path.join(model_dir, "*.json")) + glob.glob(os.path.join(model_dir, "*.safetensors")):
        os.symlink(os.path.abspath(f), os.path.join(out, os.path.basename(f)))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    vocab = min(512, json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"])
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
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
    with tempfile.TemporaryDirectory() as tmp:
        sys.argv = ["convert_hf_to_gguf.py", stage(model_dir, tmp), "--outfile", out_file, "--outtype", outtype]
        conv.main()


if __name__ == "__main__":
    main()
