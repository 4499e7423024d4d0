"""The CUDA path (graphs per stage and padded batch, the lookahead pipeline). Skipped without CUDA."""
import pytest
import torch

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.engine.reference import reference_generate

from helpers import ARCHS, fresh_model, policy, random_requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("graphs,pipeline", [(False, False), (True, False), (True, True)])
def test_cuda_engine_equals_reference(arch, layout, graphs, pipeline):
    m = fresh_model(arch).cuda()  # a model of its own: .cuda() moves it in place
    reqs = random_requests(0, n=8, prompt_len=(1, 12), max_new=(2, 10))
    pol = policy(arch, lookahead=True)
    eng = LLMEngine(m, EngineConfig(kv_layout=layout, max_batch_size=4, exit_threshold=0.55, lookahead=True,
                                    kv_cache_tokens=512, cuda_graphs=graphs, pipeline=pipeline))
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in reqs]
    while eng.has_unfinished():
        eng.step()
    for s, (p, n) in zip(seqs, reqs):
        ref = reference_generate(m, p, n, pol, kv_layout=layout)
        assert s.output_ids == ref.token_ids and s.exit_depths == ref.exit_depths
    assert eng.blocks.all_free
