"""Speculative decoding (vLLM v1's spec_decode): a proposer guesses a request's next tokens, one
graph call verifies them, and the request keeps those the model would have produced itself.

- `proposer`: the `Proposer` interface and the registry that picks one by name
  (`--speculative-method`: `ngram`, vLLM's prompt lookup; a draft model would register there).
- `ngram`: the n-gram ("prompt lookup") proposer, a file per proposer.
- `draft`: a request's draft state (its history, how well its guesses fare, when it pauses) and how
  many guesses its step may verify (`draft_room`).
- `speculator`: one model's decisions around a verification: what each request feeds, the model's
  own token after each fed token, how many each keeps, the counters.
- `verifier`: the block verifier, one call per capacity class reading the class's cache in place,
  and the commit that writes only the kept tokens' K/V.

Why the tokens are those of the plain stream: the verification call returns the model's logits after
the request's last token and after each guess. The model's own token at each position is sampled
exactly as without speculation (greedy: the argmax; sampled: the request's uniform for that token
index, service.engine.sampler), and a guess is kept while it equals that token; the first token that
differs is kept too (the "bonus" token), and the guesses after it are dropped. With a deterministic
proposer (a point mass q on each guess) this is the standard rejection rule: a guess d is accepted
with probability min(1, p(d) / q(d)) = p(d), and on rejection the token comes from p without d,
renormalised; drawing it with the request's own uniform is one way to draw from that distribution,
so the tokens are exactly those the stream samples without speculation (seeded streams stay
reproducible, and resume after an engine restart to the same text).

Only the tokens kept have their K/V written into the store (`verifier.BlockVerifier.commit`): a
rejected guess's K/V never enters a row, a capacity class or the prefix cache, under every cache
policy.
"""
