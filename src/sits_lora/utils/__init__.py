"""Small shared pieces: the result stamp (``env``), the cache folder (``cache``), byte units and rates
(``units``). Nothing here imports the rest of sits_lora."""
