import json,sys,collections
rows=[json.loads(l) for l in open(sys.argv[1])]
rows=rows[-int(sys.argv[2]):] if len(sys.argv)>2 else rows
c=collections.Counter(); m=collections.Counter()
for r in rows:
    k=(r['path'],r['reason'])
    c[k]+=1
    if not r.get('slo_met'): m[k]+=1
for k in c: print(k,c[k],'missed',m[k])
sp=[r for r in rows if r['path']=='disaggregated' and r.get('predicted_ttft_s') is not None and r.get('ttft_s')]
e=sorted(r['ttft_s']-r['predicted_ttft_s'] for r in sp)
if e: print('split err n',len(e),'med',e[len(e)//2],'p90',e[int(.9*len(e))])
late=[r for r in rows if r.get('ttft_s') and r['ttft_s']>10]
print('ttft>10:',len(late),collections.Counter((r['path'],r['reason']) for r in late))
print('pred of late', sorted(round(r.get('predicted_ttft_s') or -1,1) for r in late))
