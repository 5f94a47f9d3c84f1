"""Small shared pieces: the result stamp (``env``), the cache folder (``cache``), byte units and rates
(``units``), the timer (``timing``) and the device measurements made with it (``device_probe``), the max over
the ranks of a distributed run (``distributed``). Nothing here imports the rest of sits_lora."""
