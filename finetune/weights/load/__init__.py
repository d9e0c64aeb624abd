"""Loading the frozen base, one pass down: `model.load_with_plan` resolves the name, the checkpoint and the
attention kernel (resolve.py), builds the meta skeleton with transformers' own quantizer (skeleton.py), plans
every parameter (loadplan.py) and sets it for the placement (placement.py): read by one reader per machine
(reader.py, tensorfile.py), quantized piece by piece (quantize.py), each rank's packed bytes sent to it alone
(packed.py)."""
