"""The OpenAI request layer, shared by the router and the workers.

``bodies`` parses and validates completion and chat bodies; ``tokenizer`` loads a
tokenizer; ``chat`` renders chat templates; ``images`` reads image parts; ``prompts`` turns a
request into the token prompt both sides hash; ``tokenize_api`` answers ``/tokenize``.
"""
