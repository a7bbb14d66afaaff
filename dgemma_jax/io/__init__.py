"""Checkpoint and tokenizer I/O."""

from dgemma_jax.io.chat import (chat_images, history_without_thinking, load_chat_template, render_chat,
                                strip_thinking)
from dgemma_jax.io.hf import load_hf, save_hf
from dgemma_jax.io.images import ImageBatch, ImageSettings, encode_with_images, load_image, preprocess_images
from dgemma_jax.io.tokenizer import Tokenizer, load_tokenizer
