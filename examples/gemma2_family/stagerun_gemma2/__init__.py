"""Gemma 2 as a stagerun model family: a third-party plugin made of stagerun's traits.

Gemma 2's blocks are Gemma 3's without the query and key norms: a norm before and after
both attention and MLP, a GELU-tanh gated MLP, embeddings scaled by sqrt(d_model), and every
other layer (the even ones) attending through a sliding window. Its scores and logits are
softcapped (``gemma2.attn_logit_softcapping``, ``gemma2.final_logit_softcapping``), which
stagerun reads from any file that sets them. Its GGUF files carry a chat template; one that
does not gets Gemma's turn format below.
"""

from __future__ import annotations

from stagerun.model import Family

__all__ = ["GEMMA2", "GEMMA_TEMPLATE"]

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

GEMMA2 = Family(
    "gemma2",
    rope_interleaved=False,  # Hugging Face's halves order, llama.cpp's NEOX RoPE
    post_norms=True,
    activation="gelu_tanh",
    embedding_scale=True,
    sliding_window_pattern=2,
    chat_template=GEMMA_TEMPLATE,
)
