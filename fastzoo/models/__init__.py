"""One architecture per file; ``fastzoo/configs/*.yaml`` names the variants."""
