"""Named sets of TensorFlow op types, defined once for every stage (frontend, calibration, rewriter).

Plain frozensets of op-type strings; no TensorFlow import.

Example::

    from tag.ir.op_types import VARIABLE_TYPES
    "VarHandleOp" in VARIABLE_TYPES     # True
"""
from __future__ import annotations

#: ops that create a variable (resource handle or TF1 ref variable)
VARIABLE_TYPES = frozenset({"VarHandleOp", "VariableV2", "Variable"})
#: ops through which a batch is fed
PLACEHOLDER_TYPES = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})
#: tf.data iterator outputs (another batch source)
ITERATOR_TYPES = frozenset({"IteratorGetNext", "IteratorGetNextSync"})
#: ops that assign a variable its initial value
INITIALIZER_TYPES = frozenset({"Assign", "AssignVariableOp"})
#: functional control flow and function calls (bodies are FunctionDefs in the graph's library)
IF_TYPES = frozenset({"If", "StatelessIf"})
CASE_TYPES = frozenset({"Case", "StatelessCase"})
CALL_TYPES = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
WHILE_TYPES = frozenset({"While", "StatelessWhile"})
FUNCTION_CALL_TYPES = IF_TYPES | CASE_TYPES | CALL_TYPES | WHILE_TYPES
#: TF1 dataflow loops (Enter/Exit frames), which the rewriter does not handle
TF1_LOOP_TYPES = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration",
                            "LoopCond"})
#: ops that write a variable they take as their first input (assignments and scatters, ref and resource):
#: TF1 optimizers update a weight through these, with no Apply op, when its gradient is sparse
VARIABLE_WRITE_TYPES = frozenset({
    "Assign", "AssignAdd", "AssignSub", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ScatterAdd", "ScatterSub", "ScatterUpdate", "ScatterMul", "ScatterDiv", "ScatterMin", "ScatterMax",
    "ScatterNdAdd", "ScatterNdSub", "ScatterNdUpdate", "ResourceScatterAdd", "ResourceScatterSub",
    "ResourceScatterUpdate", "ResourceScatterMul", "ResourceScatterDiv", "ResourceScatterMin",
    "ResourceScatterMax", "ResourceScatterNdAdd", "ResourceScatterNdSub", "ResourceScatterNdUpdate"})
#: TensorList ops (the loop state of functional While loops: Keras RNNs, tf.scan, while_v2 gradients);
#: they move or view data (0 FLOPs)
TENSOR_LIST_TYPES = frozenset({
    "EmptyTensorList", "TensorListReserve", "TensorListFromTensor", "TensorListStack", "TensorListGetItem",
    "TensorListSetItem", "TensorListPushBack", "TensorListPushBackBatch", "TensorListPopBack",
    "TensorListLength", "TensorListElementShape", "TensorListConcat", "TensorListConcatV2", "TensorListConcatLists",
    "TensorListGather", "TensorListScatter", "TensorListScatterV2", "TensorListScatterIntoExistingList",
    "TensorListSplit", "TensorListResize"})
