"""The order's confirmation: deduplicated per order, enqueued in the order's transaction."""

from __future__ import annotations

from celery import shared_task

from taskdedup.celery import deduplicate

from .models import Confirmation


@deduplicate("until_executed", keys=["order_id"])
@shared_task
def send_confirmation(order_id: int) -> int:
    Confirmation.objects.create(order_id=order_id)  # (the e-mail a real shop would send)
    return order_id
