"""Issue 62's 2-layer Llama, which the DDP and FSDP2 witness tests train on Gloo ranks
(tests/ddp_witness_test.py, tests/fsdp2_witness_test.py; tests/ranks_test.cc's
IssueLlama is the same model in memledger's terms, tests/verify_cli_test.cc its
config.json)."""

import json
import os
from pathlib import Path

# tests/testdata/issue_llama.config.json, which verify_cli_test gives verify too.
CONFIG = json.loads((Path(os.path.realpath(__file__)).parent / "testdata" /
                     "issue_llama.config.json").read_text())
# Its parameters, by hand: embed_tokens and lm_head 512 x 64 = 32,768 each; a layer's
# q 64 x 64 = 4,096, k and v 32 x 64 = 2,048 each, o 4,096, gate, up and down
# 160 x 64 = 10,240 each, two norms of 64: 43,136; the final norm 64.
# 2 x 32,768 + 2 x 43,136 + 64 = 151,872 fp32 elements, 607,488 B, in 2 x 9 + 3 = 21
# tensors.
PARAM_BYTES = 151872 * 4
TENSORS = 21
