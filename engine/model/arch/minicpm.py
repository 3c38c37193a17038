"""MiniCPM: embeddings times ``scale_emb``; an untied head reads h / (hidden / dim_model_base)
(a tied one, in mlx-lm, does not). Depth-scaled residuals live inside mlx-lm's layers."""

from __future__ import annotations

import mlx.core as mx

from engine.model.arch.stack import Stack


class MiniCPM(Stack):
    family = "minicpm"

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens) * self.text.args.scale_emb

    def project(self, h: mx.array) -> mx.array:
        args = self.text.args
        if args.tie_word_embeddings:
            return h @ self.inner.embed_tokens.weight.T
        return self.text.lm_head(h / (args.hidden_size / args.dim_model_base))
