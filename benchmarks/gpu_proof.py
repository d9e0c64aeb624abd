"""`python -m benchmarks.gpu_proof`: the GPU proof under the name the team brief and the issues cite; the code
is benchmarks/gpu/proof.py (`python -m benchmarks.gpu.proof`), same arguments."""
import sys

from benchmarks.gpu.proof import main

if __name__ == "__main__":
    sys.exit(main())
