"""Frontend: a TensorFlow training GraphDef -> the ``TrainingGraph`` IR, and the model zoo.  [TensorFlow]

Example::

    from tag.frontend import analyze, zoo
    tg = analyze(zoo.training_graph("resnet50", batch_size=32))
    tg.num_parameters
"""
from tag.frontend.analyze import analyze

__all__ = ["analyze"]
