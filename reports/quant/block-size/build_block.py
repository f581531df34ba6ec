"""Build the default engines with another MatMulNBits block size (target linears, LM head, shared embedding; the
drafter layers keep theirs): an experiment, not a build option.

    python reports/quant/block-size/build_block.py 64 /tmp/eng/b64
"""
import sys
from dspark_export.exporter import quantize as Q
blk = int(sys.argv[1])
Q.WeightFormat.__init__.__defaults__ = ("fp32", blk, 4)
from dspark_export import cli
sys.exit(cli.main(["build", "--out", sys.argv[2], "--overwrite"] + sys.argv[3:]))
