"""Wire contracts: the only thing kvlane services share on the wire.

`subjects` names every NATS subject and Redis key, `messages` holds the
internal msgspec Structs, `openai_api` the HTTP types of the OpenAI subset,
and `openapi` builds the OpenAPI document from those same Structs.
"""
