"""Process groups, collectives with autograd, tensor-parallel layers and gradient reduction."""
