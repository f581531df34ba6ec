"""ONNX Runtime profile of the drafter block (R = 1, 1 thread, 40 runs): each run right after a target pass (cold) and
back to back (warm); node time by op type and the nodes that lose most. Writes bprof*.json in the working folder.

    python cap.py ENGINE_DIR && python blkprof.py ENGINE_DIR
"""
import pickle, time, json, collections, sys
import numpy as np, onnxruntime as ort
f = pickle.load(open('feeds.pkl','rb'))
tfeed = f['target.N4.json']; bfeed = f['drafter_block.R1.json']
eng = sys.argv[1]
def mk(path, threads, spin, prof=False):
    so = ort.SessionOptions(); so.log_severity_level = 3; so.intra_op_num_threads = threads
    so.add_session_config_entry('session.intra_op.allow_spinning', '1' if spin else '0')
    if prof: so.enable_profiling = True; so.profile_file_prefix = 'bprof'
    return ort.InferenceSession(path, so, providers=['CPUExecutionProvider'])
T = mk(eng + '/graphs/target.onnx', 2, True)
res = {}
for mode in ['cold', 'warm']:
    B = mk(eng + '/graphs/drafter_block.onnx', 1, False, True)
    for _ in range(5): B.run(None, bfeed)
    for _ in range(40):
        if mode == 'cold': T.run(None, tfeed)
        B.run(None, bfeed)
    p = B.end_profiling()
    ev = json.load(open(p))
    agg = collections.defaultdict(float); runs = 0
    for e in ev:
        if e.get('cat') == 'Node' and e['name'].endswith('_kernel_time'):
            agg[(e['args']['op_name'], e['name'][:-12])] += e['dur']
        if e.get('cat') == 'Session' and e['name'] == 'model_run': runs += 1
    res[mode] = ({k: v / runs for k, v in agg.items()}, runs)
cold, warm = res['cold'][0], res['warm'][0]
print('runs', res['cold'][1], res['warm'][1], 'total node us cold %.0f warm %.0f' % (sum(cold.values()), sum(warm.values())))
byop = collections.defaultdict(lambda: [0, 0])
for k in cold: byop[k[0]][0] += cold[k]; byop[k[0]][1] += warm.get(k, 0)
for op, (c, w) in sorted(byop.items(), key=lambda x: -x[1][0])[:14]: print(f"{op:24s} cold {c:7.0f} us warm {w:7.0f}")
print('top nodes by cold-warm:')
for k in sorted(cold, key=lambda k: -(cold[k] - warm.get(k, 0)))[:12]: print(f"  {k[1][:60]:60s} {k[0]:20s} cold {cold[k]:6.0f} warm {warm.get(k,0):6.0f}")
