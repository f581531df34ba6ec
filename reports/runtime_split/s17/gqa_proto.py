"""Prototype: the target graph with each layer's attention replaced by ORT's GroupQueryAttention (one request,
RoPE already applied, KV cache shared in place through IOBinding). Times one pass against the current graph."""
import sys, time, re
import numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto
src, dst = sys.argv[1], sys.argv[2]
m = onnx.load(src)
g = m.graph
layers = sorted({int(x) for x in re.findall(r"/target/layers\.(\d+)/attn/q_rope", " ".join(n.name for n in g.node))})
H, KVH, HD = 9, 3, 64
new_nodes = []
for l in layers:
    p = f"/target/layers.{l}/attn/"
    q = p + "q_rope/RotaryEmbedding/output_0"; k = p + "k_rope/RotaryEmbedding/output_0"; v = p + "qkv_split/Split/output_2"
    unpad = [n for n in g.node if n.name == p + "unpad/Gather"][0]
    out = unpad.output[0]
    g.node.remove(unpad)
    new_nodes.append(helper.make_node("GroupQueryAttention", [q, k, v, f"past_key.{l}", f"past_value.{l}", "gqa_seqlens_k",
        "gqa_total_len"], [out, f"present_key.{l}", f"present_value.{l}"], name=p + "GQA", domain="com.microsoft",
        num_heads=H, kv_num_heads=KVH, scale=1.0 / np.sqrt(HD)))
g.node.extend(new_nodes)
g.input.extend([helper.make_tensor_value_info("gqa_seqlens_k", TensorProto.INT32, ["R"]),
                helper.make_tensor_value_info("gqa_total_len", TensorProto.INT32, [])])
keep = [o for o in g.output if o.name in ("logits", "aux_hidden")]
del g.output[:]; g.output.extend(keep)
for l in layers:
    for kv in ("key", "value"):
        g.output.append(helper.make_tensor_value_info(f"present_{kv}.{l}", TensorProto.FLOAT, ["R", KVH, "P", HD]))
# dead-code elimination
while True:
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    dead = [n for n in g.node if not any(o in used for o in n.output if o)]
    if not dead: break
    for n in dead: g.node.remove(n)
used = {i for n in g.node for i in n.input}
for i in list(g.input):
    if i.name not in used: g.input.remove(i)
if not any(o.domain == "com.microsoft" for o in m.opset_import):
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
onnx.save(m, dst, save_as_external_data=True, location=dst.split("/")[-1] + ".data")
print("nodes", len(g.node), "inputs", [i.name for i in g.input][:8])
