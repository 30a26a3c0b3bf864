from services.worker.main import main_for_role
from shared.runner import run_service

run_service("prefill_worker", main_for_role("prefill"))
