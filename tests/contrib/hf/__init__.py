"""Tests of the Hugging Face wing: TGI's and TEI's routes, ``InferenceClient`` against them."""
