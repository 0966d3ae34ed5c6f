"""Export to Hugging Face folders and import from them."""
