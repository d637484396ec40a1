"""Tests of the OpenAI wing: ``/v1`` embeddings, completions, chats, rerank and tokenize."""
