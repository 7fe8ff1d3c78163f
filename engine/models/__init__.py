"""Model implementations (Llama family)."""
