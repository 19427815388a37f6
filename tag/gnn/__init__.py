"""Graph neural network policy (DGL, TensorFlow backend) giving the tree search a prior over actions.  [DGL]

The only package that imports DGL.
"""
