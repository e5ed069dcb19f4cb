import pytest


def make_record(rid="r0", gamma=3, verified=3, accepted=0, committed=None, confidence=None, load=1,
                step=None, domain="", stop=False, logits=None):
    """A schema-valid round record with only the fields a test cares about set."""
    committed = accepted + 1 if committed is None else committed
    record = {
        "request_id": rid, "domain": domain, "round": 0, "position": 1, "draft": list(range(gamma)),
        "confidence": list(confidence) if confidence is not None else [0.5] * gamma,
        "confidence_logits": logits, "verified": verified, "accepted": accepted, "committed": committed,
        "tokens": list(range(committed)), "bonus": accepted == verified and committed == accepted + 1,
        "stop": stop, "load": load, "temperature": 1.0,
    }
    if step is not None:
        record["step"] = step
    return record


@pytest.fixture
def record():
    return make_record
