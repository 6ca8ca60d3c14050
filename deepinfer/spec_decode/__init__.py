"""Speculative decoding: drafters propose, MTPVarlen (C++) picks verify lengths, verify accepts."""
