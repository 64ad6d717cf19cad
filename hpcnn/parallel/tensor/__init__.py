"""Operator (tensor) parallelism in Megatron-LM's form.

- :mod:`.mappings`: the primitive movements (all-gather, reduce-scatter, split, allreduce) and
  their conjugate pairs (identity forward / allreduce backward, ...), each documented both ways;
- :mod:`.linear`: column- and row-parallel Linear, the parallel MLP block, sharded parameters;
- :mod:`.attention`: head-parallel causal self-attention and the parallel transformer block;
- :mod:`.vocab`: the vocabulary-parallel embedding and cross-entropy;
- :mod:`.channel_conv`: the channel-parallel convolution;
- :mod:`.factories`: the tensor-parallel GPT and CNN, built as the serial factories build theirs.
"""
